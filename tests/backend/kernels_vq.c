/*
 * VQ codec tests: smoothing factors (hand-computed), smooth + Hadamard
 * transforms against the O(D^2) reference and q.k invariance, encode equal to
 * the reference and to the argmin over the codebook for every d and b,
 * decode round trip, corrupt codes, wrappers, and the point of it all:
 * smoothing + rotation lowers the q.k error of VQ keys with outlier channels.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kvdepot/vq.h"
#include "testutil.h"

static void test_smooth_hand(kvd_backend *be)
{
    float k[6] = {1, -4, 0, -9, 2, 0};
    float l[3], lr[3];
    int64_t ks[2] = {2, 3}, ls = 3;
    kvd_tensor tk = kvd_tensor_make(KVD_DTYPE_F32, k, 2, ks);
    kvd_tensor tl = kvd_tensor_make(KVD_DTYPE_F32, l, 1, &ls);
    kvd_error err;
    TU_CHECK(kvd_vq_smooth_factors(be, &tk, &tl, &err) == 0, "smooth: %s", err.msg);
    kvd_vq_smooth_factors_ref(2, 3, k, lr);
    TU_CHECK(l[0] == 3.0f && l[1] == 2.0f && l[2] == 1.0f, "smooth: %g %g %g", l[0], l[1], l[2]);
    TU_CHECK(!memcmp(l, lr, sizeof l), "smooth: backend != ref");
    /* f16 input gives the same factors */
    uint16_t kh[6];
    tu_f32_to_f16(kh, k, 6);
    kvd_tensor tkh = kvd_tensor_make(KVD_DTYPE_F16, kh, 2, ks);
    TU_CHECK(kvd_vq_smooth_factors(be, &tkh, &tl, &err) == 0 && !memcmp(l, lr, sizeof l),
             "smooth f16");
}

static void test_transform(kvd_backend *be)
{
    tu_rng r;
    tu_rng_seed(&r, 3);
    for (int D = 1; D <= 256; D *= 2) {
        int64_t T = 37, H = 4;
        float *k = malloc(sizeof(float) * T * D), *q = malloc(sizeof(float) * H * D);
        float *kt = malloc(sizeof(float) * T * D), *qt = malloc(sizeof(float) * H * D);
        float *kr = malloc(sizeof(float) * T * D), *qr = malloc(sizeof(float) * H * D);
        float *lam = malloc(sizeof(float) * D);
        tu_kv_opts o = {D >= 8 ? 2 : 0, 20.0f, 0.3f, D >= 2};
        tu_gen_kv(&r, k, T, D, &o);
        tu_fill_normal(&r, q, H * D, 1.0f);
        kvd_vq_smooth_factors_ref(T, D, k, lam);
        int64_t ks[2] = {T, D}, qs[2] = {H, D}, ls = D;
        kvd_tensor tk = kvd_tensor_make(KVD_DTYPE_F32, k, 2, ks);
        kvd_tensor tkt = kvd_tensor_make(KVD_DTYPE_F32, kt, 2, ks);
        kvd_tensor tq = kvd_tensor_make(KVD_DTYPE_F32, q, 2, qs);
        kvd_tensor tqt = kvd_tensor_make(KVD_DTYPE_F32, qt, 2, qs);
        kvd_tensor tl = kvd_tensor_make(KVD_DTYPE_F32, lam, 1, &ls);
        kvd_error err;
        int rc = kvd_vq_transform_keys(be, &tk, &tl, &tkt, &err);
        TU_CHECK(rc == 0, "transform keys D=%d: %s", D, err.msg);
        rc = kvd_vq_transform_queries(be, &tq, &tl, &tqt, &err);
        TU_CHECK(rc == 0, "transform queries D=%d: %s", D, err.msg);
        kvd_vq_transform_keys_ref(T, D, k, lam, kr);
        kvd_vq_transform_queries_ref(H, D, q, lam, qr);
        TU_CHECK(tu_nmse(kr, kt, T * D) < 1e-10, "keys D=%d nmse %g", D, tu_nmse(kr, kt, T * D));
        TU_CHECK(tu_nmse(qr, qt, H * D) < 1e-10, "queries D=%d nmse %g", D,
                 tu_nmse(qr, qt, H * D));
        /* q~.k~ == q.k */
        double num = 0, den = 0;
        for (int h = 0; h < H; h++)
            for (int64_t t = 0; t < T; t++) {
                double a = 0, b = 0;
                for (int i = 0; i < D; i++) {
                    a += (double)q[h * D + i] * k[t * D + i];
                    b += (double)qt[h * D + i] * kt[t * D + i];
                }
                num += (a - b) * (a - b);
                den += a * a;
            }
        TU_CHECK(num <= 1e-10 * den + 1e-20, "q.k not preserved D=%d: %g / %g", D, num, den);
        /* no smoothing: Hadamard only */
        rc = kvd_vq_transform_keys(be, &tk, NULL, &tkt, &err);
        kvd_vq_transform_keys_ref(T, D, k, NULL, kr);
        TU_CHECK(rc == 0 && tu_nmse(kr, kt, T * D) < 1e-10, "hadamard-only D=%d", D);
        free(k);
        free(q);
        free(kt);
        free(qt);
        free(kr);
        free(qr);
        free(lam);
    }
    /* D not a power of two */
    float x[12], y[12];
    int64_t s[2] = {2, 6};
    kvd_tensor tx = kvd_tensor_make(KVD_DTYPE_F32, x, 2, s), ty = kvd_tensor_make(KVD_DTYPE_F32, y, 2, s);
    TU_CHECK(kvd_vq_transform_keys(be, &tx, NULL, &ty, NULL) == KVD_EINVAL, "D=6 accepted");
}

static void test_encode_decode(kvd_backend *be_fast, kvd_backend *be_ref)
{
    tu_rng r;
    tu_rng_seed(&r, 11);
    const int D = 64;
    for (int d = 2; d <= 8; d *= 2)
        for (int b = 4; b <= 12; b++) {
            int64_t T = b >= 11 ? 9 : 33, P = D / d, K = 1 << b;
            float *x = malloc(sizeof(float) * T * D), *cb = malloc(sizeof(float) * K * d);
            float *y = malloc(sizeof(float) * T * D);
            tu_fill_normal(&r, x, T * D, 1.0f);
            tu_fill_normal(&r, cb, K * d, 1.0f);
            /* a few sub-vectors equal to codebook rows, and exact duplicates
             * in the codebook (ties go to the lower row) */
            memcpy(x, cb + 5 * d, sizeof(float) * d);
            memcpy(cb + 9 * d, cb + 3 * d, sizeof(float) * d);
            memcpy(x + d, cb + 3 * d, sizeof(float) * d);
            size_t cbytes = (size_t)T * P * (b > 8 ? 2 : 1);
            tu_buf cf = tu_buf_new(cbytes), cr = tu_buf_new(cbytes);
            kvd_dtype cdt = b > 8 ? KVD_DTYPE_U16 : KVD_DTYPE_U8;
            int64_t xs[2] = {T, D}, cbs[2] = {K, d}, cs[2] = {T, P};
            kvd_tensor tx = kvd_tensor_make(KVD_DTYPE_F32, x, 2, xs);
            kvd_tensor ty = kvd_tensor_make(KVD_DTYPE_F32, y, 2, xs);
            kvd_tensor tcb = kvd_tensor_make(KVD_DTYPE_F32, cb, 2, cbs);
            kvd_tensor tcf = kvd_tensor_make(cdt, cf.data, 2, cs);
            kvd_tensor tcr = kvd_tensor_make(cdt, cr.data, 2, cs);
            kvd_error err;
            TU_CHECK(kvd_vq_encode(be_fast, &tx, &tcb, &tcf, &err) == 0, "encode: %s", err.msg);
            TU_CHECK(kvd_vq_encode(be_ref, &tx, &tcb, &tcr, &err) == 0, "encode ref: %s", err.msg);
            TU_CHECK(tu_guard_ok(&cf) && tu_guard_ok(&cr), "encode guards d=%d b=%d", d, b);
            TU_CHECK(!memcmp(cf.data, cr.data, cbytes), "encode fast != ref d=%d b=%d", d, b);
            /* argmin over the codebook, independently in double */
            int bad = 0;
            for (int64_t i = 0; i < T * P && !bad; i++) {
                uint32_t c = b > 8 ? ((uint16_t *)cf.data)[i] : ((uint8_t *)cf.data)[i];
                double best = INFINITY, got = 0;
                for (int64_t j = 0; j < K; j++) {
                    double s = 0;
                    for (int t = 0; t < d; t++) {
                        double df = (double)x[i * d + t] - cb[j * d + t];
                        s += df * df;
                    }
                    if (s < best)
                        best = s;
                    if (j == c)
                        got = s;
                }
                bad = c >= K || got > best + 1e-5 * (1 + best);
            }
            TU_CHECK(!bad, "encode is not the argmin d=%d b=%d", d, b);
            uint32_t c0 = b > 8 ? ((uint16_t *)cf.data)[0] : ((uint8_t *)cf.data)[0];
            uint32_t c1 = b > 8 ? ((uint16_t *)cf.data)[1] : ((uint8_t *)cf.data)[1];
            TU_CHECK(c0 == 5 && c1 == 3, "exact/tied rows: got %u %u (d=%d b=%d)", c0, c1, d, b);
            /* decode: rows of the codebook; fast == ref */
            TU_CHECK(kvd_vq_decode(be_fast, &tcf, &tcb, &ty, &err) == 0, "decode: %s", err.msg);
            float *yr = malloc(sizeof(float) * T * D);
            kvd_vq_decode_ref(T, D, d, b, b > 8 ? NULL : cf.data, b > 8 ? cf.data : NULL, cb, yr);
            TU_CHECK(!memcmp(y, yr, sizeof(float) * T * D), "decode fast != ref");
            TU_CHECK(!memcmp(y, cb + 5 * d, sizeof(float) * d), "decode of an exact row");
            /* round trip: decode(encode(decoded)) is a fixed point */
            kvd_tensor tyy = kvd_tensor_make(KVD_DTYPE_F32, yr, 2, xs);
            TU_CHECK(kvd_vq_encode(be_fast, &tyy, &tcb, &tcr, &err) == 0, "re-encode");
            TU_CHECK(kvd_vq_decode(be_fast, &tcr, &tcb, &ty, &err) == 0 &&
                         !memcmp(y, yr, sizeof(float) * T * D),
                     "decode(encode(decode)) != decode d=%d b=%d", d, b);
            /* corrupt code */
            if (b < 8 || (b > 8 && b < 16)) {
                if (b > 8)
                    ((uint16_t *)cf.data)[T * P - 1] = (uint16_t)K;
                else
                    ((uint8_t *)cf.data)[T * P - 1] = (uint8_t)K;
                TU_CHECK(kvd_vq_decode(be_fast, &tcf, &tcb, &ty, &err) == KVD_ECORRUPT &&
                             kvd_vq_decode(be_ref, &tcf, &tcb, &ty, &err) == KVD_ECORRUPT,
                         "corrupt code accepted d=%d b=%d", d, b);
            }
            /* wrong code dtype */
            kvd_tensor twrong = kvd_tensor_make(b > 8 ? KVD_DTYPE_U8 : KVD_DTYPE_U16, cf.data, 2, cs);
            TU_CHECK(kvd_vq_encode(be_fast, &tx, &tcb, &twrong, &err) == KVD_EINVAL,
                     "wrong code dtype accepted");
            free(yr);
            free(x);
            free(y);
            free(cb);
            tu_buf_free(&cf);
            tu_buf_free(&cr);
        }
    /* T = 0 */
    float cb[16 * 4] = {0};
    int64_t xs[2] = {0, 64}, cbs[2] = {16, 4}, cs[2] = {0, 16};
    kvd_tensor tx = kvd_tensor_make(KVD_DTYPE_F32, NULL, 2, xs);
    kvd_tensor tcb = kvd_tensor_make(KVD_DTYPE_F32, cb, 2, cbs);
    kvd_tensor tc = kvd_tensor_make(KVD_DTYPE_U8, NULL, 2, cs);
    TU_CHECK(kvd_vq_encode(be_fast, &tx, &tcb, &tc, NULL) == 0, "T=0 encode");
    TU_CHECK(kvd_vq_decode(be_fast, &tc, &tcb, &tx, NULL) == 0, "T=0 decode");
}

/* q.k error of VQ-coded keys (d4b8) with and without smooth + Hadamard. */
static double qk_error(kvd_backend *be, const float *k, const float *q, int64_t T, int D, int H,
                       int transform)
{
    const int d = 4, b = 8, K = 1 << b;
    float *kt = malloc(sizeof(float) * T * D), *qt = malloc(sizeof(float) * H * D);
    float *kd = malloc(sizeof(float) * T * D), *cb = malloc(sizeof(float) * K * d);
    uint8_t *codes = malloc(T * (D / d));
    float lam[256];
    int64_t ks[2] = {T, D}, qs[2] = {H, D}, ls = D, cbs[2] = {K, d}, cs[2] = {T, D / d};
    kvd_tensor tk = kvd_tensor_make(KVD_DTYPE_F32, (void *)k, 2, ks);
    kvd_tensor tq = kvd_tensor_make(KVD_DTYPE_F32, (void *)q, 2, qs);
    kvd_tensor tkt = kvd_tensor_make(KVD_DTYPE_F32, kt, 2, ks);
    kvd_tensor tqt = kvd_tensor_make(KVD_DTYPE_F32, qt, 2, qs);
    kvd_tensor tkd = kvd_tensor_make(KVD_DTYPE_F32, kd, 2, ks);
    kvd_tensor tl = kvd_tensor_make(KVD_DTYPE_F32, lam, 1, &ls);
    kvd_tensor tcb = kvd_tensor_make(KVD_DTYPE_F32, cb, 2, cbs);
    kvd_tensor tc = kvd_tensor_make(KVD_DTYPE_U8, codes, 2, cs);
    if (transform) {
        kvd_vq_smooth_factors(be, &tk, &tl, NULL);
        kvd_vq_transform_keys(be, &tk, &tl, &tkt, NULL);
        kvd_vq_transform_queries(be, &tq, &tl, &tqt, NULL);
    } else {
        memcpy(kt, k, sizeof(float) * T * D);
        memcpy(qt, q, sizeof(float) * H * D);
    }
    kvd_kmeans_params km = {0, 12, 77, 16384};
    double inertia = 0;
    kvd_error err;
    TU_CHECK(kvd_vq_train(be, &tkt, &km, &tcb, &inertia, &err) == 0, "vq train: %s", err.msg);
    TU_CHECK(inertia > 0, "inertia %g", inertia);
    kvd_vq_encode(be, &tkt, &tcb, &tc, NULL);
    kvd_vq_decode(be, &tc, &tcb, &tkd, NULL);
    double num = 0, den = 0;
    for (int h = 0; h < H; h++)
        for (int64_t t = 0; t < T; t++) {
            double a = 0, e = 0;
            for (int i = 0; i < D; i++) {
                a += (double)q[h * D + i] * k[t * D + i];
                e += (double)qt[h * D + i] * kd[t * D + i];
            }
            num += (a - e) * (a - e);
            den += a * a;
        }
    free(kt);
    free(qt);
    free(kd);
    free(cb);
    free(codes);
    return num / den;
}

static void test_accuracy(kvd_backend *be)
{
    tu_rng r;
    tu_rng_seed(&r, 21);
    const int64_t T = 2048;
    const int D = 128, H = 4;
    float *k = malloc(sizeof(float) * T * D), *q = malloc(sizeof(float) * H * D);
    tu_kv_opts o = {4, 20.0f, 0.3f, 1};
    tu_gen_kv(&r, k, T, D, &o);
    tu_fill_normal(&r, q, H * D, 1.0f);
    double e_raw = qk_error(be, k, q, T, D, H, 0);
    double e_tr = qk_error(be, k, q, T, D, H, 1);
    printf("vq d4b8 q.k relative error: raw %.4g, smooth+hadamard %.4g\n", e_raw, e_tr);
    TU_CHECK(e_tr < e_raw, "smooth+Hadamard does not help: %g vs %g", e_tr, e_raw);
    TU_CHECK(e_tr < 0.1, "VQ q.k error too large: %g", e_tr);
    free(k);
    free(q);
}

int main(void)
{
    kvd_backend *fast = tu_cpu_backend(2, 0), *ref = tu_cpu_backend(1, 1);
    test_smooth_hand(fast);
    test_smooth_hand(ref);
    test_transform(fast);
    test_transform(ref);
    test_encode_decode(fast, ref);
    test_accuracy(fast);
    kvd_backend_free(fast);
    kvd_backend_free(ref);
    return tu_report("kernels_vq");
}
