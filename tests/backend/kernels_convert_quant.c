/*
 * CPU backend core ops against their scalar references: dtype conversion,
 * Walsh-Hadamard transform, per-channel scaling, INT2/INT4 quantize and
 * dequantize. Three backends run every case: the reference (force_ref), the
 * fast path on 1 thread and the fast path on 4 threads; outputs live in
 * guard-byte buffers. Quantization is bit-exact by specification, so codes
 * and parameters are compared byte for byte.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kvdepot/backend.h"
#include "kvdepot/convert.h"
#include "kvdepot/quant.h"
#include "testutil.h"

static kvd_backend *be_ref, *be_fast1, *be_fastN;

static uint32_t f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static float bits_f32(uint32_t u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Identical floats, or both NaN. */
static int same_float(float a, float b) { return (isnan(a) && isnan(b)) || f32_bits(a) == f32_bits(b); }

/* Value of element i of an array of dtype t. */
static float elem(const void *p, kvd_dtype t, size_t i)
{
    if (t == KVD_DTYPE_F16)
        return kvd_f16_to_f32(((const uint16_t *)p)[i]);
    if (t == KVD_DTYPE_BF16)
        return kvd_bf16_to_f32(((const uint16_t *)p)[i]);
    return ((const float *)p)[i];
}

/* Value of one 16-bit element of dtype t (f16 or bf16). */
static float val16(uint16_t h, kvd_dtype t) { return t == KVD_DTYPE_F16 ? kvd_f16_to_f32(h) : kvd_bf16_to_f32(h); }

static void fill_dtype(void *dst, kvd_dtype t, const float *src, size_t n)
{
    if (t == KVD_DTYPE_F16)
        tu_f32_to_f16(dst, src, n);
    else if (t == KVD_DTYPE_BF16)
        tu_f32_to_bf16(dst, src, n);
    else
        memcpy(dst, src, n * 4);
}

static const kvd_dtype float_types[3] = {KVD_DTYPE_F32, KVD_DTYPE_F16, KVD_DTYPE_BF16};

/* ================= conversion ================= */

static void test_convert_exhaustive(void)
{
    /* every f16 and bf16 bit pattern -> f32 and back, fast vs reference */
    size_t n = 65536;
    uint16_t *h = malloc(n * 2), *back_ref = malloc(n * 2);
    for (size_t i = 0; i < n; i++)
        h[i] = (uint16_t)i;
    for (int k = 1; k < 3; k++) {
        kvd_dtype t = float_types[k];
        tu_buf out = tu_buf_new(n * 4), back = tu_buf_new(n * 2);
        int64_t shape[1] = {(int64_t)n};
        kvd_tensor src = kvd_tensor_make(t, h, 1, shape);
        kvd_tensor dst = kvd_tensor_make(KVD_DTYPE_F32, out.data, 1, shape);
        kvd_tensor bk = kvd_tensor_make(t, back.data, 1, shape);
        TU_CHECK(kvd_convert(be_fastN, &dst, &src, NULL) == KVD_OK, "convert %s", kvd_dtype_name(t));
        TU_CHECK(kvd_convert(be_fastN, &bk, &dst, NULL) == KVD_OK, "convert back");
        TU_CHECK(tu_guard_ok(&out) && tu_guard_ok(&back), "guards");
        int bad = 0;
        for (size_t i = 0; i < n; i++) {
            float want = t == KVD_DTYPE_F16 ? kvd_f16_to_f32(h[i]) : kvd_bf16_to_f32(h[i]);
            float got = ((float *)out.data)[i];
            uint16_t wb = t == KVD_DTYPE_F16 ? kvd_f32_to_f16(want) : kvd_f32_to_bf16(want);
            uint16_t gb = ((uint16_t *)back.data)[i];
            if (!same_float(want, got))
                bad++;
            if (isnan(want) ? !isnan(val16(gb, t)) : wb != gb)
                bad++;
            /* finite and infinite values round-trip exactly */
            if (!isnan(want) && gb != h[i])
                bad++;
        }
        TU_CHECK(bad == 0, "%s exhaustive round trip: %d mismatches", kvd_dtype_name(t), bad);
        tu_buf_free(&out);
        tu_buf_free(&back);
    }
    free(h);
    free(back_ref);

    /* random f32 bit patterns (NaN, Inf, subnormals, ties) -> f16/bf16 */
    tu_rng r;
    tu_rng_seed(&r, 11);
    n = 100003;
    float *x = malloc(n * 4);
    for (size_t i = 0; i < n; i++) {
        uint32_t u = (uint32_t)tu_rng_u64(&r);
        if (i % 7 == 0) /* exact f16 ties: 13 low mantissa bits = 0x1000 */
            u = (u & ~0x1fffu) | 0x1000u;
        if (i % 11 == 0) /* f16 range */
            u = (u & 0x807fffffu) | ((uint32_t)(103 + tu_rng_below(&r, 40)) << 23);
        x[i] = bits_f32(u);
    }
    for (int k = 1; k < 3; k++) {
        kvd_dtype t = float_types[k];
        int64_t shape[1] = {(int64_t)n};
        tu_buf a = tu_buf_new(n * 2), b = tu_buf_new(n * 2);
        kvd_tensor src = kvd_tensor_make(KVD_DTYPE_F32, x, 1, shape);
        kvd_tensor da = kvd_tensor_make(t, a.data, 1, shape), db = kvd_tensor_make(t, b.data, 1, shape);
        TU_CHECK(kvd_convert(be_ref, &da, &src, NULL) == KVD_OK, "ref");
        TU_CHECK(kvd_convert(be_fastN, &db, &src, NULL) == KVD_OK, "fast");
        TU_CHECK(tu_guard_ok(&a) && tu_guard_ok(&b), "guards");
        int bad = 0;
        for (size_t i = 0; i < n; i++) {
            uint16_t p = ((uint16_t *)a.data)[i], q = ((uint16_t *)b.data)[i];
            float pv = val16(p, t), qv = val16(q, t);
            if (isnan(pv) ? !isnan(qv) : p != q)
                bad++;
        }
        TU_CHECK(bad == 0, "f32 -> %s: %d mismatches", kvd_dtype_name(t), bad);
        tu_buf_free(&a);
        tu_buf_free(&b);
    }
    free(x);
}

/* Strided and odd-shaped conversions between every pair of dtypes. */
static void test_convert_shapes(void)
{
    tu_rng r;
    tu_rng_seed(&r, 12);
    const int64_t lens[] = {0, 1, 7, 8, 9, 33, 100};
    for (int si = 0; si < 3; si++)
        for (int di = 0; di < 3; di++)
            for (size_t li = 0; li < sizeof lens / sizeof lens[0]; li++) {
                kvd_dtype ts = float_types[si], td = float_types[di];
                int64_t n = lens[li], rows = 5, cols = 3;
                /* src: a (rows, cols, n) view into a (rows, cols + 2, n + 3)
                 * buffer; dst: a transposed view (rows, cols, n) of a
                 * (n, cols, rows) buffer. */
                size_t es = kvd_dtype_size(ts), ed = kvd_dtype_size(td);
                size_t scount = (size_t)(rows * (cols + 2) * (n + 3));
                float *vals = malloc((scount + 1) * 4);
                tu_fill_normal(&r, vals, scount, 3.0f);
                tu_inject_nonfinite(&r, vals, scount, 3);
                void *sbuf = malloc((scount + 1) * es);
                fill_dtype(sbuf, ts, vals, scount);
                kvd_tensor src = {ts, 3, {rows, cols, n}, {0}, sbuf};
                src.stride[2] = (int64_t)es;
                src.stride[1] = (n + 3) * (int64_t)es;
                src.stride[0] = (cols + 2) * src.stride[1];
                size_t dcount = (size_t)(rows * cols * n);
                tu_buf d1 = tu_buf_new(dcount * ed), d2 = tu_buf_new(dcount * ed),
                       d3 = tu_buf_new(dcount * ed);
                kvd_tensor dst = {td, 3, {rows, cols, n}, {0}, NULL};
                dst.stride[0] = (int64_t)ed;
                dst.stride[1] = rows * (int64_t)ed;
                dst.stride[2] = rows * cols * (int64_t)ed;
                kvd_tensor t1 = dst, t2 = dst, t3 = dst;
                t1.data = d1.data;
                t2.data = d2.data;
                t3.data = d3.data;
                TU_CHECK(kvd_convert(be_ref, &t1, &src, NULL) == KVD_OK, "ref");
                TU_CHECK(kvd_convert(be_fast1, &t2, &src, NULL) == KVD_OK, "fast1");
                TU_CHECK(kvd_convert(be_fastN, &t3, &src, NULL) == KVD_OK, "fastN");
                TU_CHECK(tu_guard_ok(&d1) && tu_guard_ok(&d2) && tu_guard_ok(&d3), "guards");
                int bad = 0;
                for (size_t i = 0; i < dcount; i++) {
                    float a = elem(d1.data, td, i);
                    if (!same_float(a, elem(d2.data, td, i)) || !same_float(a, elem(d3.data, td, i)))
                        bad++;
                }
                /* the reference itself: element (i, j, k) */
                for (int64_t i = 0; i < rows; i++)
                    for (int64_t j = 0; j < cols; j++)
                        for (int64_t k = 0; k < n; k++) {
                            float v = elem(sbuf, ts, (size_t)((i * (cols + 2) + j) * (n + 3) + k));
                            float w = elem(d1.data, td, (size_t)(k * cols * rows + j * rows + i));
                            float want = td == KVD_DTYPE_F16    ? kvd_f16_to_f32(kvd_f32_to_f16(v))
                                         : td == KVD_DTYPE_BF16 ? kvd_bf16_to_f32(kvd_f32_to_bf16(v))
                                                                : v;
                            if (!same_float(want, w))
                                bad++;
                        }
                TU_CHECK(bad == 0, "convert %s -> %s n=%lld: %d mismatches", kvd_dtype_name(ts),
                         kvd_dtype_name(td), (long long)n, bad);
                tu_buf_free(&d1);
                tu_buf_free(&d2);
                tu_buf_free(&d3);
                free(sbuf);
                free(vals);
            }
}

/* ================= Hadamard ================= */

static void test_hadamard(void)
{
    kvd_error err;
    /* hand cases */
    {
        float x[4] = {1, 1, 1, 1}, y[4];
        int64_t s[1] = {4};
        kvd_tensor tx = kvd_tensor_make(KVD_DTYPE_F32, x, 1, s), ty = kvd_tensor_make(KVD_DTYPE_F32, y, 1, s);
        kvd_backend *bes[3] = {be_ref, be_fast1, be_fastN};
        for (int b = 0; b < 3; b++) {
            TU_CHECK(kvd_hadamard(bes[b], &ty, &tx, NULL) == KVD_OK, "h4");
            TU_CHECK(fabsf(y[0] - 2) < 1e-6f && fabsf(y[1]) < 1e-6f && fabsf(y[2]) < 1e-6f &&
                         fabsf(y[3]) < 1e-6f,
                     "H4 [1,1,1,1] = [2,0,0,0], got [%g %g %g %g]", y[0], y[1], y[2], y[3]);
        }
        float a[8] = {1, 0, 0, 0, 0, 0, 0, 0}, c[8];
        int64_t s8[1] = {8};
        kvd_tensor ta = kvd_tensor_make(KVD_DTYPE_F32, a, 1, s8), tc = kvd_tensor_make(KVD_DTYPE_F32, c, 1, s8);
        for (int b = 0; b < 3; b++) {
            TU_CHECK(kvd_hadamard(bes[b], &tc, &ta, NULL) == KVD_OK, "h8");
            int ok = 1;
            for (int i = 0; i < 8; i++)
                ok &= fabsf(c[i] - 0.35355339f) < 1e-6f;
            TU_CHECK(ok, "H8 e0 = 1/sqrt(8) everywhere (backend %d)", b);
        }
        /* e1 -> column 1 of H: +,-,+,-,... */
        a[0] = 0;
        a[1] = 1;
        TU_CHECK(kvd_hadamard(be_fast1, &tc, &ta, NULL) == KVD_OK, "h8 e1");
        TU_CHECK(c[0] > 0 && c[1] < 0 && c[2] > 0 && c[3] < 0 && c[7] < 0, "H8 e1 signs");
        /* not a power of two */
        int64_t s6[2] = {2, 6};
        float z[12] = {0};
        kvd_tensor t6 = kvd_tensor_make(KVD_DTYPE_F32, z, 2, s6);
        TU_CHECK(kvd_hadamard(be_fast1, &t6, &t6, &err) == KVD_EINVAL && strstr(err.msg, "power of two"),
                 "n=6 rejected: %s", err.msg);
    }
    tu_rng r;
    tu_rng_seed(&r, 13);
    const int64_t ns[] = {1, 2, 4, 8, 16, 32, 64, 128, 256};
    const int64_t rowss[] = {0, 1, 3, 37};
    for (size_t ni = 0; ni < sizeof ns / sizeof ns[0]; ni++)
        for (size_t ri = 0; ri < sizeof rowss / sizeof rowss[0]; ri++)
            for (int di = 0; di < 3; di++) {
                int64_t n = ns[ni], rows = rowss[ri];
                kvd_dtype td = float_types[di];
                size_t cnt = (size_t)(n * rows);
                float *x = malloc(cnt * 4 + 4);
                tu_gen_kv(&r, x, rows, n, NULL);
                if (ri == 3)
                    tu_inject_nonfinite(&r, x, cnt, 2);
                int64_t shape[2] = {rows, n};
                kvd_tensor src = kvd_tensor_make(KVD_DTYPE_F32, x, 2, shape);
                size_t ed = kvd_dtype_size(td);
                tu_buf o[3];
                kvd_backend *bes[3] = {be_ref, be_fast1, be_fastN};
                for (int b = 0; b < 3; b++) {
                    o[b] = tu_buf_new(cnt * ed);
                    kvd_tensor dst = kvd_tensor_make(td, o[b].data, 2, shape);
                    TU_CHECK(kvd_hadamard(bes[b], &dst, &src, NULL) == KVD_OK, "hadamard");
                    TU_CHECK(tu_guard_ok(&o[b]), "guard");
                }
                float *a = malloc(cnt * 4 + 4), *c = malloc(cnt * 4 + 4);
                for (int b = 1; b < 3; b++) {
                    for (size_t i = 0; i < cnt; i++) {
                        a[i] = elem(o[0].data, td, i);
                        c[i] = elem(o[b].data, td, i);
                    }
                    double tol = td == KVD_DTYPE_F32 ? 1e-11 : td == KVD_DTYPE_F16 ? 1e-6 : 1e-4;
                    double e = tu_nmse(a, c, cnt);
                    TU_CHECK(e <= tol, "hadamard n=%lld rows=%lld %s: nmse %g", (long long)n,
                             (long long)rows, kvd_dtype_name(td), e);
                    TU_CHECK(tu_nonfinite_parity(a, c, cnt) < 0, "hadamard NaN/Inf parity n=%lld",
                             (long long)n);
                }
                /* applying it twice gives the input back (finite rows, f32) */
                if (td == KVD_DTYPE_F32 && ri != 3 && cnt) {
                    kvd_tensor t = kvd_tensor_make(KVD_DTYPE_F32, o[1].data, 2, shape);
                    TU_CHECK(kvd_hadamard(be_fast1, &t, &t, NULL) == KVD_OK, "in place");
                    double e = tu_nmse(x, o[1].data, cnt);
                    TU_CHECK(e < 1e-12, "H(H(x)) = x, nmse %g", e);
                }
                for (int b = 0; b < 3; b++)
                    tu_buf_free(&o[b]);
                free(a);
                free(c);
                free(x);
            }
}

/* ================= channel scaling ================= */

static void test_channel_scale(void)
{
    tu_rng r;
    tu_rng_seed(&r, 14);
    const int64_t ns[] = {1, 5, 8, 13, 128};
    for (size_t ni = 0; ni < sizeof ns / sizeof ns[0]; ni++)
        for (int divide = 0; divide < 2; divide++)
            for (int di = 0; di < 3; di++) {
                int64_t n = ns[ni], rows = 9;
                kvd_dtype td = float_types[di];
                size_t cnt = (size_t)(rows * n);
                float *x = malloc(cnt * 4);
                tu_gen_kv(&r, x, rows, n, NULL);
                tu_inject_nonfinite(&r, x, cnt, 2);
                /* scale as f16 with a stride of 2 elements; one zero */
                uint16_t *s = malloc((size_t)n * 4);
                for (int64_t j = 0; j < n; j++)
                    s[2 * j] = kvd_f32_to_f16(0.25f + tu_rng_uniform(&r) * 4);
                s[2 * (n - 1)] = 0;
                kvd_tensor ts = {KVD_DTYPE_F16, 1, {n}, {4}, s};
                int64_t shape[2] = {rows, n};
                kvd_tensor src = kvd_tensor_make(KVD_DTYPE_F32, x, 2, shape);
                size_t ed = kvd_dtype_size(td);
                tu_buf o[3];
                kvd_backend *bes[3] = {be_ref, be_fast1, be_fastN};
                for (int b = 0; b < 3; b++) {
                    o[b] = tu_buf_new(cnt * ed);
                    kvd_tensor dst = kvd_tensor_make(td, o[b].data, 2, shape);
                    TU_CHECK(kvd_channel_scale(bes[b], &dst, &src, &ts, divide, NULL) == KVD_OK, "scale");
                    TU_CHECK(tu_guard_ok(&o[b]), "guard");
                }
                int bad = 0;
                for (size_t i = 0; i < cnt; i++) {
                    float c = kvd_f16_to_f32(s[2 * (i % (size_t)n)]);
                    float want = divide ? x[i] / c : x[i] * c;
                    if (td == KVD_DTYPE_F16)
                        want = kvd_f16_to_f32(kvd_f32_to_f16(want));
                    else if (td == KVD_DTYPE_BF16)
                        want = kvd_bf16_to_f32(kvd_f32_to_bf16(want));
                    for (int b = 0; b < 3; b++)
                        if (!same_float(want, elem(o[b].data, td, i)))
                            bad++;
                }
                TU_CHECK(bad == 0, "channel_scale n=%lld divide=%d %s: %d mismatches", (long long)n,
                         divide, kvd_dtype_name(td), bad);
                for (int b = 0; b < 3; b++)
                    tu_buf_free(&o[b]);
                free(s);
                free(x);
            }
    /* argument checks */
    float x[8] = {0}, sc[3] = {1, 1, 1};
    int64_t shape[2] = {2, 4}, s3[1] = {3};
    kvd_tensor t = kvd_tensor_make(KVD_DTYPE_F32, x, 2, shape), ts = kvd_tensor_make(KVD_DTYPE_F32, sc, 1, s3);
    kvd_error err;
    TU_CHECK(kvd_channel_scale(be_fast1, &t, &t, &ts, 0, &err) == KVD_EINVAL && strstr(err.msg, "length 4"),
             "scale length mismatch: %s", err.msg);
    int64_t shape2[2] = {2, 3};
    kvd_tensor t2 = kvd_tensor_make(KVD_DTYPE_F32, x, 2, shape2);
    TU_CHECK(kvd_convert(be_fast1, &t2, &t, &err) == KVD_EINVAL && strstr(err.msg, "dim 1"),
             "convert shape mismatch: %s", err.msg);
    kvd_tensor tu8 = kvd_tensor_make(KVD_DTYPE_U8, x, 2, shape);
    TU_CHECK(kvd_convert(be_fast1, &tu8, &t, &err) == KVD_EINVAL && strstr(err.msg, "u8"),
             "convert to u8: %s", err.msg);
}

/* ================= quantization ================= */

typedef struct qbufs {
    tu_buf codes, min, scale, sum;
    kvd_qtensor q;
} qbufs;

static void qbufs_init(qbufs *b, int64_t T, int64_t D, int bits, int P, kvd_quant_axis axis)
{
    kvd_quant_sizes s;
    if (kvd_quant_size(T, D, bits, P, axis, &s, NULL) != KVD_OK)
        abort();
    b->codes = tu_buf_new(s.codes_bytes);
    b->min = tu_buf_new(s.ngroups * 2);
    b->scale = tu_buf_new(s.ngroups * 2);
    b->sum = tu_buf_new(s.ngroups * 2);
    kvd_qtensor_init(&b->q, T, D, bits, P, axis, NULL, NULL);
    b->q.codes = b->codes.data;
    b->q.min = b->min.data;
    b->q.scale = b->scale.data;
    b->q.sum = b->sum.data;
}

static int qbufs_guards(const qbufs *b)
{
    return tu_guard_ok(&b->codes) && tu_guard_ok(&b->min) && tu_guard_ok(&b->scale) &&
           tu_guard_ok(&b->sum);
}

static int qbufs_equal(const qbufs *a, const qbufs *b)
{
    return memcmp(a->codes.data, b->codes.data, a->codes.bytes) == 0 &&
           memcmp(a->min.data, b->min.data, a->min.bytes) == 0 &&
           memcmp(a->scale.data, b->scale.data, a->scale.bytes) == 0 &&
           memcmp(a->sum.data, b->sum.data, a->sum.bytes) == 0;
}

static void qbufs_free(qbufs *b)
{
    tu_buf_free(&b->codes);
    tu_buf_free(&b->min);
    tu_buf_free(&b->scale);
    tu_buf_free(&b->sum);
}

/* Code of element (t, d) and index of its group. */
static uint32_t qcode(const kvd_qtensor *q, int64_t t, int64_t d, int64_t *gi)
{
    int per = 8 / q->bits;
    int64_t row, pos;
    if (q->axis == KVD_QAXIS_TOKEN) {
        row = t;
        pos = d;
        *gi = t * (q->dim / q->group) + d / q->group;
    } else {
        row = d;
        pos = t;
        *gi = d * (q->ntok / q->group) + t / q->group;
    }
    int64_t rowbytes = (q->axis == KVD_QAXIS_TOKEN ? q->dim : q->ntok) * q->bits / 8;
    return (q->codes[row * rowbytes + pos / per] >> ((pos % per) * q->bits)) & ((1u << q->bits) - 1);
}

static void test_quant_hand(void)
{
    kvd_backend *bes[3] = {be_ref, be_fast1, be_fastN};
    for (int b = 0; b < 3; b++) {
        /* [0, 1, 2, 3, 0, ...]: 2 bits -> codes 0..3, min 0, scale 1, sum 6 */
        float x[32] = {0, 1, 2, 3};
        int64_t shape[2] = {1, 32};
        kvd_tensor tx = kvd_tensor_make(KVD_DTYPE_F32, x, 2, shape);
        qbufs q;
        qbufs_init(&q, 1, 32, 2, 32, KVD_QAXIS_TOKEN);
        TU_CHECK(kvd_quantize(bes[b], &tx, &q.q, KVD_ROUND_NEAREST, 0, NULL) == KVD_OK, "quantize");
        TU_CHECK(q.q.codes[0] == 0xE4 && q.q.codes[1] == 0, "codes 0,1,2,3 pack to 0xE4, got 0x%02x",
                 q.q.codes[0]);
        TU_CHECK(q.q.min[0] == kvd_f32_to_f16(0) && q.q.scale[0] == kvd_f32_to_f16(1) && q.q.sum[0] == 6,
                 "min 0 scale 1 sum 6: got %g %g %u", kvd_f16_to_f32(q.q.min[0]),
                 kvd_f16_to_f32(q.q.scale[0]), q.q.sum[0]);
        TU_CHECK(qbufs_guards(&q), "guards");
        qbufs_free(&q);

        /* 4 bits, x_j = j % 16 over 64 values in 2 groups of 32: bytes 0x10, 0x32... */
        float y[64];
        for (int j = 0; j < 64; j++)
            y[j] = (float)(j % 16) - 4.0f;
        int64_t s2[2] = {1, 64};
        kvd_tensor ty = kvd_tensor_make(KVD_DTYPE_F32, y, 2, s2);
        qbufs q4;
        qbufs_init(&q4, 1, 64, 4, 32, KVD_QAXIS_TOKEN);
        TU_CHECK(kvd_quantize(bes[b], &ty, &q4.q, KVD_ROUND_NEAREST, 0, NULL) == KVD_OK, "quantize4");
        TU_CHECK(q4.q.codes[0] == 0x10 && q4.q.codes[1] == 0x32 && q4.q.codes[7] == 0xFE &&
                     q4.q.codes[16] == 0x10,
                 "4-bit packing: %02x %02x %02x", q4.q.codes[0], q4.q.codes[1], q4.q.codes[7]);
        TU_CHECK(kvd_f16_to_f32(q4.q.min[1]) == -4.0f && kvd_f16_to_f32(q4.q.scale[1]) == 1.0f &&
                     q4.q.sum[0] == 240 && q4.q.sum[1] == 240,
                 "4-bit params");
        qbufs_free(&q4);

        /* channel axis: channel 0 = t % 4 (2 bits), channel 1 constant 5,
         * channel 2 rounding: 1.5 -> 2 (half rounds up), 0.49 -> 0 */
        float v[32 * 3];
        for (int t = 0; t < 32; t++) {
            v[t * 3 + 0] = (float)(t % 4);
            v[t * 3 + 1] = 5.0f;
            v[t * 3 + 2] = t == 0 ? 0.0f : t == 1 ? 3.0f : t == 2 ? 1.5f : 0.49f;
        }
        int64_t s3[2] = {32, 3};
        kvd_tensor tv = kvd_tensor_make(KVD_DTYPE_F32, v, 2, s3);
        qbufs qc;
        qbufs_init(&qc, 32, 3, 2, 32, KVD_QAXIS_CHANNEL);
        TU_CHECK(kvd_quantize(bes[b], &tv, &qc.q, KVD_ROUND_NEAREST, 0, NULL) == KVD_OK, "quantize ch");
        TU_CHECK(qc.q.codes[0] == 0xE4 && qc.q.sum[0] == 48, "channel 0 codes/sum");
        TU_CHECK(kvd_f16_to_f32(qc.q.min[1]) == 5.0f && qc.q.scale[1] == 0 && qc.q.sum[1] == 0 &&
                     qc.q.codes[8] == 0,
                 "constant channel: min 5 scale 0 codes 0");
        TU_CHECK(qc.q.codes[16] == (0 | 3 << 2 | 2 << 4 | 0 << 6), "rounding: got 0x%02x", qc.q.codes[16]);
        float out[96];
        kvd_tensor to = kvd_tensor_make(KVD_DTYPE_F32, out, 2, s3);
        TU_CHECK(kvd_dequantize(bes[b], &qc.q, &to, NULL) == KVD_OK, "dequantize ch");
        TU_CHECK(out[1] == 5.0f && out[3 * 31 + 1] == 5.0f && out[3 * 5] == 1.0f && out[3 * 2 + 2] == 2.0f,
                 "dequantized: %g %g %g", out[1], out[15], out[8]);
        qbufs_free(&qc);

        /* non-finite: NaN -> 0, +Inf -> qmax, -Inf -> 0; min/max from finite values */
        float w[32];
        for (int j = 0; j < 32; j++)
            w[j] = (float)(j % 4);
        w[5] = NAN;
        w[6] = INFINITY;
        w[7] = -INFINITY;
        kvd_tensor tw = kvd_tensor_make(KVD_DTYPE_F32, w, 2, shape);
        qbufs qn;
        qbufs_init(&qn, 1, 32, 2, 32, KVD_QAXIS_TOKEN);
        TU_CHECK(kvd_quantize(bes[b], &tw, &qn.q, KVD_ROUND_STOCHASTIC, 7, NULL) == KVD_OK, "quantize nan");
        int64_t gi;
        TU_CHECK(qcode(&qn.q, 0, 5, &gi) == 0 && qcode(&qn.q, 0, 6, &gi) == 3 && qcode(&qn.q, 0, 7, &gi) == 0,
                 "NaN -> 0, +Inf -> 3, -Inf -> 0");
        TU_CHECK(kvd_f16_to_f32(qn.q.min[0]) == 0.0f && kvd_f16_to_f32(qn.q.scale[0]) == 1.0f,
                 "min/max over finite values");
        /* all NaN: min 0, scale 0 */
        for (int j = 0; j < 32; j++)
            w[j] = NAN;
        TU_CHECK(kvd_quantize(bes[b], &tw, &qn.q, KVD_ROUND_NEAREST, 0, NULL) == KVD_OK, "all nan");
        TU_CHECK(qn.q.min[0] == 0 && qn.q.scale[0] == 0 && qn.q.sum[0] == 0, "all-NaN group");
        /* beyond f16: clamped to +-65504 */
        for (int j = 0; j < 32; j++)
            w[j] = j & 1 ? 1e30f : -1e30f;
        TU_CHECK(kvd_quantize(bes[b], &tw, &qn.q, KVD_ROUND_NEAREST, 0, NULL) == KVD_OK, "huge");
        TU_CHECK(kvd_f16_to_f32(qn.q.min[0]) == -65504.0f && qn.q.codes[0] == 0xCC,
                 "huge values clamp: min %g codes 0x%02x", kvd_f16_to_f32(qn.q.min[0]), qn.q.codes[0]);
        /* min not representable in f16: rounded down, so codes stay in range */
        for (int j = 0; j < 32; j++)
            w[j] = 0.1f + 0.01f * (float)j;
        TU_CHECK(kvd_quantize(bes[b], &tw, &qn.q, KVD_ROUND_NEAREST, 0, NULL) == KVD_OK, "0.1");
        TU_CHECK(kvd_f16_to_f32(qn.q.min[0]) <= 0.1f &&
                     kvd_f16_to_f32(qn.q.min[0]) + 3 * kvd_f16_to_f32(qn.q.scale[0]) >= w[31],
                 "grid covers the group");
        qbufs_free(&qn);
    }
}

/* One random case on all three backends; checks bytes, guards, error bound. */
static void quant_case(tu_rng *r, int64_t T, int64_t D, int bits, int P, kvd_quant_axis axis,
                       kvd_rounding rnd, kvd_dtype dt, int strided, int nonfinite)
{
    size_t n = (size_t)(T * D);
    float *xf = malloc(n * 4 + 4);
    tu_kv_opts o = {D >= 8 ? 3 : 0, 25.0f, 0.4f, 1};
    tu_gen_kv(r, xf, T, D, &o);
    if (nonfinite)
        tu_inject_nonfinite(r, xf, n, 1 + n / 500);
    /* strided: x is a (T, D) view of a (D, T + 3) buffer (channel-major),
     * else a (T, D + 5)-padded buffer */
    size_t es = kvd_dtype_size(dt);
    size_t bufn = strided ? (size_t)(D * (T + 3)) : (size_t)(T * (D + 5));
    char *xb = malloc(bufn * es + 8);
    float *xv = malloc(n * 4 + 4); /* value of x(t, d) as the op sees it */
    kvd_tensor x = {dt, 2, {T, D}, {0}, xb};
    if (strided) {
        x.stride[0] = (int64_t)es;
        x.stride[1] = (T + 3) * (int64_t)es;
    } else {
        x.stride[0] = (D + 5) * (int64_t)es;
        x.stride[1] = (int64_t)es;
    }
    for (int64_t t = 0; t < T; t++)
        for (int64_t d = 0; d < D; d++) {
            char *p = xb + t * x.stride[0] + d * x.stride[1];
            fill_dtype(p, dt, &xf[t * D + d], 1);
            xv[t * D + d] = elem(p, dt, 0);
        }
    const uint64_t seed = 0x1234567890abcdefull ^ (uint64_t)(T * 131 + D);
    qbufs q[3];
    kvd_backend *bes[3] = {be_ref, be_fast1, be_fastN};
    for (int b = 0; b < 3; b++) {
        qbufs_init(&q[b], T, D, bits, P, axis);
        kvd_error err;
        int rc = kvd_quantize(bes[b], &x, &q[b].q, rnd, seed, &err);
        TU_CHECK(rc == KVD_OK, "quantize: %s", err.msg);
        TU_CHECK(qbufs_guards(&q[b]), "quantize guards T=%lld D=%lld", (long long)T, (long long)D);
    }
    TU_CHECK(qbufs_equal(&q[0], &q[1]) && qbufs_equal(&q[0], &q[2]),
             "fast == ref bytes: T=%lld D=%lld bits=%d P=%d axis=%d rnd=%d %s strided=%d nf=%d",
             (long long)T, (long long)D, bits, P, axis, rnd, kvd_dtype_name(dt), strided, nonfinite);

    /* stored sums, error bound (round to nearest: |x - y| <= scale/2) */
    const kvd_qtensor *qq = &q[0].q;
    kvd_quant_sizes sz;
    kvd_quant_size(T, D, bits, P, axis, &sz, NULL);
    uint32_t *sums = calloc(sz.ngroups + 1, 4);
    int bad_bound = 0;
    for (int64_t t = 0; t < T; t++)
        for (int64_t d = 0; d < D; d++) {
            int64_t gi;
            uint32_t c = qcode(qq, t, d, &gi);
            sums[gi] += c;
            float v = xv[t * D + d];
            if (!isfinite(v) || fabsf(v) > 65504.0f)
                continue;
            float mn = kvd_f16_to_f32(qq->min[gi]), sc = kvd_f16_to_f32(qq->scale[gi]);
            float y = mn + sc * (float)c;
            float bound = rnd == KVD_ROUND_NEAREST ? sc * 0.5f : sc;
            if (fabsf(v - y) > bound * (1.0f + 1e-5f) + 1e-6f * fabsf(v) + 1e-30f)
                bad_bound++;
        }
    int bad_sum = 0;
    for (size_t g = 0; g < sz.ngroups; g++)
        bad_sum += sums[g] != qq->sum[g];
    TU_CHECK(bad_sum == 0, "stored sums: %d wrong", bad_sum);
    TU_CHECK(bad_bound == 0, "error bound violated %d times (T=%lld D=%lld bits=%d P=%d rnd=%d)",
             bad_bound, (long long)T, (long long)D, bits, P, rnd);
    free(sums);

    /* dequantize to every dtype, strided output, on every backend */
    for (int oi = 0; oi < 3; oi++) {
        kvd_dtype od = float_types[oi];
        size_t ed = kvd_dtype_size(od);
        tu_buf yb[3];
        for (int b = 0; b < 3; b++) {
            /* y: (T, D) view of a (T, D + 1)-padded buffer */
            yb[b] = tu_buf_new((size_t)(T * (D + 1)) * ed);
            kvd_tensor y = {od, 2, {T, D}, {(D + 1) * (int64_t)ed, (int64_t)ed}, yb[b].data};
            TU_CHECK(kvd_dequantize(bes[b], &q[b].q, &y, NULL) == KVD_OK, "dequantize");
            TU_CHECK(tu_guard_ok(&yb[b]), "dequantize guards");
        }
        int bad = 0;
        for (int64_t t = 0; t < T; t++)
            for (int64_t d = 0; d < D; d++) {
                size_t i = (size_t)(t * (D + 1) + d);
                float a = elem(yb[0].data, od, i);
                if (!isfinite(a) && fabsf(a) != INFINITY)
                    bad++; /* never NaN */
                if (!same_float(a, elem(yb[1].data, od, i)) || !same_float(a, elem(yb[2].data, od, i)))
                    bad++;
                int64_t gi;
                uint32_t c = qcode(qq, t, d, &gi);
                float want = kvd_f16_to_f32(qq->min[gi]) + kvd_f16_to_f32(qq->scale[gi]) * (float)c;
                float wd = od == KVD_DTYPE_F16    ? kvd_f16_to_f32(kvd_f32_to_f16(want))
                           : od == KVD_DTYPE_BF16 ? kvd_bf16_to_f32(kvd_f32_to_bf16(want))
                                                  : want;
                if (!same_float(wd, a))
                    bad++;
            }
        TU_CHECK(bad == 0, "dequantize to %s: %d mismatches", kvd_dtype_name(od), bad);
        for (int b = 0; b < 3; b++)
            tu_buf_free(&yb[b]);
    }
    for (int b = 0; b < 3; b++)
        qbufs_free(&q[b]);
    free(xb);
    free(xv);
    free(xf);
}

static void test_quant_random(void)
{
    tu_rng r;
    tu_rng_seed(&r, 15);
    const int Ps[5] = {8, 16, 32, 64, 128};
    for (int bits = 2; bits <= 4; bits += 2)
        for (int pi = 0; pi < 5; pi++)
            for (int rnd = 0; rnd < 2; rnd++) {
                int P = Ps[pi];
                /* token axis: any T (0, 1, odd), D a multiple of P */
                const int64_t Ts[] = {0, 1, 3, 17};
                for (size_t ti = 0; ti < 4; ti++)
                    quant_case(&r, Ts[ti], P * (ti % 2 ? 1 : 2), bits, P, KVD_QAXIS_TOKEN, rnd,
                               float_types[ti % 3], (int)(ti & 1), ti == 3);
                /* channel axis: T a multiple of P, any D (1, odd) */
                const int64_t Ds[] = {1, 3, 17, 128};
                for (size_t di = 0; di < 4; di++)
                    quant_case(&r, P * (di % 2 ? 2 : 1), Ds[di], bits, P, KVD_QAXIS_CHANNEL, rnd,
                               float_types[(di + 1) % 3], (int)(di & 1), di == 2);
                quant_case(&r, 0, 5, bits, P, KVD_QAXIS_CHANNEL, rnd, KVD_DTYPE_F16, 0, 0);
                /* channel counts a multiple of 8 with contiguous channels take
                 * the in-place tile kernels */
                quant_case(&r, P * 3, 8, bits, P, KVD_QAXIS_CHANNEL, rnd, KVD_DTYPE_F32, 0, 1);
                quant_case(&r, P, 64, bits, P, KVD_QAXIS_CHANNEL, rnd, KVD_DTYPE_BF16, 0, 0);
                quant_case(&r, P * 2, 128, bits, P, KVD_QAXIS_CHANNEL, rnd, KVD_DTYPE_F16, 0, 1);
            }
    /* big enough to run on several threads: bytes must not depend on them */
    for (int axis = 0; axis < 2; axis++)
        for (int rnd = 0; rnd < 2; rnd++)
            quant_case(&r, 1024, 128, 2 + 2 * axis, 64, (kvd_quant_axis)axis, rnd, KVD_DTYPE_F16, 0, 1);
}

/* Tiny values (f16 subnormal min/scale), huge ones (near the f16 limit) and
 * mixed signs: the parameter rounding must agree between paths. */
static void test_quant_extremes(void)
{
    tu_rng r;
    tu_rng_seed(&r, 16);
    const float mags[] = {1e-9f, 1e-7f, 3e-5f, 1.0f, 2e4f, 6.5e4f, 1e6f};
    for (size_t mi = 0; mi < sizeof mags / sizeof mags[0]; mi++)
        for (int axis = 0; axis < 2; axis++)
            for (int bits = 2; bits <= 4; bits += 2) {
                int64_t T = 64, D = 64;
                float *x = malloc((size_t)(T * D) * 4);
                for (int64_t i = 0; i < T * D; i++)
                    x[i] = mags[mi] * (tu_rng_uniform(&r) - (mi & 1 ? 0.2f : 0.0f));
                int64_t shape[2] = {T, D};
                kvd_tensor tx = kvd_tensor_make(KVD_DTYPE_F32, x, 2, shape);
                qbufs q[3];
                kvd_backend *bes[3] = {be_ref, be_fast1, be_fastN};
                for (int b = 0; b < 3; b++) {
                    qbufs_init(&q[b], T, D, bits, 32, (kvd_quant_axis)axis);
                    TU_CHECK(kvd_quantize(bes[b], &tx, &q[b].q, KVD_ROUND_STOCHASTIC, mi, NULL) == KVD_OK, "q");
                }
                TU_CHECK(qbufs_equal(&q[0], &q[1]) && qbufs_equal(&q[0], &q[2]),
                         "extreme magnitude %g axis %d bits %d: fast == ref", mags[mi], axis, bits);
                for (int b = 0; b < 3; b++)
                    qbufs_free(&q[b]);
                free(x);
            }
}

static void test_quant_stochastic(void)
{
    /* rows [0, 3, 1.3 x 30]: min 0, scale 1; E[code of 1.3] = 1.3 */
    int64_t T = 1024, D = 32;
    float *x = malloc((size_t)(T * D) * 4);
    for (int64_t t = 0; t < T; t++) {
        x[t * D] = 0;
        x[t * D + 1] = 3;
        for (int64_t d = 2; d < D; d++)
            x[t * D + d] = 1.3f;
    }
    int64_t shape[2] = {T, D};
    kvd_tensor tx = kvd_tensor_make(KVD_DTYPE_F32, x, 2, shape);
    qbufs a, b;
    qbufs_init(&a, T, D, 2, 32, KVD_QAXIS_TOKEN);
    qbufs_init(&b, T, D, 2, 32, KVD_QAXIS_TOKEN);
    TU_CHECK(kvd_quantize(be_fastN, &tx, &a.q, KVD_ROUND_STOCHASTIC, 1, NULL) == KVD_OK, "sr");
    double s = 0;
    long cnt = 0, ones = 0, twos = 0;
    for (int64_t t = 0; t < T; t++)
        for (int64_t d = 2; d < D; d++) {
            int64_t gi;
            uint32_t c = qcode(&a.q, t, d, &gi);
            s += c;
            cnt++;
            ones += c == 1;
            twos += c == 2;
        }
    double mean = s / (double)cnt;
    TU_CHECK(fabs(mean - 1.3) < 0.02, "stochastic rounding unbiased: mean %f, want 1.3", mean);
    TU_CHECK(ones + twos == cnt, "only the two neighbours are drawn");
    /* nearest would give 1 everywhere */
    TU_CHECK(kvd_quantize(be_fastN, &tx, &b.q, KVD_ROUND_NEAREST, 1, NULL) == KVD_OK, "rtn");
    int64_t gi;
    TU_CHECK(qcode(&b.q, 5, 7, &gi) == 1, "nearest rounds 1.3 to 1");
    /* same seed: same bytes; other seed: other bytes */
    TU_CHECK(kvd_quantize(be_fast1, &tx, &b.q, KVD_ROUND_STOCHASTIC, 1, NULL) == KVD_OK, "sr again");
    TU_CHECK(qbufs_equal(&a, &b), "same seed, same codes");
    TU_CHECK(kvd_quantize(be_fast1, &tx, &b.q, KVD_ROUND_STOCHASTIC, 2, NULL) == KVD_OK, "sr seed 2");
    TU_CHECK(!qbufs_equal(&a, &b), "other seed, other codes");
    /* the documented draw */
    TU_CHECK(kvd_quant_stochastic_u(1, 0) >= 0.0f && kvd_quant_stochastic_u(1, 0) < 1.0f, "u in [0,1)");
    qbufs_free(&a);
    qbufs_free(&b);
    free(x);
}

static void test_quant_args(void)
{
    kvd_error err;
    kvd_quant_sizes s;
    TU_CHECK(kvd_quant_size(256, 128, 2, 64, KVD_QAXIS_TOKEN, &s, NULL) == KVD_OK &&
                 s.codes_bytes == 8192 && s.ngroups == 512 && s.params_bytes == 3072 &&
                 s.total_bytes == 11264,
             "sizes 256x128 int2 P64");
    TU_CHECK(kvd_quant_size(256, 128, 4, 128, KVD_QAXIS_CHANNEL, &s, NULL) == KVD_OK &&
                 s.codes_bytes == 16384 && s.ngroups == 256,
             "sizes channel int4 P128");
    TU_CHECK(kvd_quant_size(10, 128, 3, 64, KVD_QAXIS_TOKEN, &s, &err) == KVD_EINVAL && strstr(err.msg, "bits"),
             "bits 3: %s", err.msg);
    TU_CHECK(kvd_quant_size(10, 128, 2, 24, KVD_QAXIS_TOKEN, &s, &err) == KVD_EINVAL && strstr(err.msg, "group"),
             "group 24: %s", err.msg);
    TU_CHECK(kvd_quant_size(10, 128, 2, 4, KVD_QAXIS_TOKEN, &s, &err) == KVD_EINVAL && strstr(err.msg, "group"),
             "group 4: %s", err.msg);
    TU_CHECK(kvd_quant_size(16, 8, 2, 8, KVD_QAXIS_TOKEN, &s, NULL) == KVD_OK && s.codes_bytes == 32 &&
                 s.ngroups == 16,
             "sizes 16x8 int2 P8");
    TU_CHECK(kvd_quant_size(10, 96, 2, 64, KVD_QAXIS_TOKEN, &s, &err) == KVD_EINVAL && strstr(err.msg, "head_dim"),
             "D 96 P 64: %s", err.msg);
    TU_CHECK(kvd_quant_size(100, 128, 2, 64, KVD_QAXIS_CHANNEL, &s, &err) == KVD_EINVAL && strstr(err.msg, "token count"),
             "T 100 P 64 channel: %s", err.msg);
    unsigned char buf[4096];
    kvd_qtensor q;
    TU_CHECK(kvd_qtensor_init(&q, 8, 128, 2, 32, KVD_QAXIS_TOKEN, buf, NULL) == KVD_OK &&
                 q.codes == buf && (unsigned char *)q.min == buf + 256 && q.scale == q.min + 32 &&
                 q.sum == q.scale + 32,
             "packed block order");
    float x[8 * 128] = {0};
    int64_t sh[2] = {8, 64};
    kvd_tensor tx = kvd_tensor_make(KVD_DTYPE_F32, x, 2, sh);
    TU_CHECK(kvd_quantize(be_fast1, &tx, &q, KVD_ROUND_NEAREST, 0, &err) == KVD_EINVAL && strstr(err.msg, "(8, 64)"),
             "shape mismatch: %s", err.msg);
    int64_t sh2[2] = {8, 128};
    kvd_tensor ti = kvd_tensor_make(KVD_DTYPE_I32, x, 2, sh2);
    TU_CHECK(kvd_quantize(be_fast1, &ti, &q, KVD_ROUND_NEAREST, 0, &err) == KVD_EINVAL && strstr(err.msg, "i32"),
             "dtype: %s", err.msg);
    kvd_tensor tf = kvd_tensor_make(KVD_DTYPE_F32, x, 2, sh2);
    TU_CHECK(kvd_quantize(be_fast1, &tf, &q, (kvd_rounding)7, 0, &err) == KVD_EINVAL, "rounding");
    TU_CHECK(kvd_quantize(NULL, &tf, &q, KVD_ROUND_NEAREST, 0, &err) == KVD_EUNSUPP, "no backend");
    q.sum = NULL;
    TU_CHECK(kvd_quantize(be_fast1, &tf, &q, KVD_ROUND_NEAREST, 0, &err) == KVD_EINVAL, "NULL array");
}

static void test_backend(void)
{
    kvd_backend *be = NULL;
    kvd_error err;
    kvd_cpu_options bad = {-1, 0, 0, 0};
    TU_CHECK(kvd_backend_cpu_create(&bad, &be, &err) == KVD_EINVAL && be == NULL, "nthreads -1");
    kvd_cpu_options bad_slots = {1, 0, -1, 0};
    TU_CHECK(kvd_backend_cpu_create(&bad_slots, &be, &err) == KVD_EINVAL && be == NULL &&
                 strstr(err.msg, "slots"),
             "slots -1");
    kvd_cpu_options bad_nice = {1, 0, 0, KVD_CPU_BACKGROUND_IDLE + 1};
    TU_CHECK(kvd_backend_cpu_create(&bad_nice, &be, &err) == KVD_EINVAL && be == NULL &&
                 strstr(err.msg, "background_nice"),
             "background_nice 21");
    bad_nice.background_nice = -2;
    TU_CHECK(kvd_backend_cpu_create(&bad_nice, &be, &err) == KVD_EINVAL && be == NULL,
             "background_nice -2");
    TU_CHECK(kvd_backend_cpu_create(NULL, &be, &err) == KVD_OK && be && be->nthreads >= 1, "defaults");
    TU_CHECK(strcmp(be->iface->name, "cpu") == 0, "name");
    TU_CHECK(be->iface->convert && be->iface->quant, "convert and quant tables present");
    void *p = NULL;
    TU_CHECK(kvd_backend_alloc(be, 1000, &p, &err) == KVD_OK && p && ((uintptr_t)p & 63) == 0, "aligned alloc");
    char host[1000], back[1000];
    for (int i = 0; i < 1000; i++)
        host[i] = (char)i;
    TU_CHECK(kvd_backend_upload(be, p, host, 1000, &err) == KVD_OK, "upload");
    TU_CHECK(kvd_backend_download(be, back, p, 1000, &err) == KVD_OK && !memcmp(host, back, 1000), "download");
    TU_CHECK(kvd_backend_sync(be, &err) == KVD_OK, "sync");
    kvd_backend_dealloc(be, p);
    TU_CHECK(kvd_backend_alloc(be, (size_t)1 << 62, &p, &err) == KVD_ENOMEM && p == NULL, "huge alloc");
    TU_CHECK(kvd_backend_alloc(be, 0, &p, &err) == KVD_OK && p, "zero alloc");
    kvd_backend_dealloc(be, p);
    kvd_backend_free(be);
    kvd_backend_free(NULL);
    kvd_backend *cu = (kvd_backend *)1;
    int rc = kvd_backend_cuda_create(-1, &cu, &err);
    TU_CHECK((rc == KVD_EUNSUPP || rc == KVD_EUNAVAIL || rc == KVD_OK) && (rc != KVD_OK) == (cu == NULL),
             "cuda create without cuda");
    if (rc == KVD_OK)
        kvd_backend_free(cu);
}

int main(void)
{
    be_ref = tu_cpu_backend(1, 1);
    be_fast1 = tu_cpu_backend(1, 0);
    be_fastN = tu_cpu_backend(4, 0);
    if (!kvd_cpu_has_avx2_fma())
        printf("note: no AVX2/FMA on this CPU; the fast backends run the reference\n");
    test_backend();
    test_convert_exhaustive();
    test_convert_shapes();
    test_hadamard();
    test_channel_scale();
    test_quant_hand();
    test_quant_args();
    test_quant_random();
    test_quant_stochastic();
    test_quant_extremes();
    kvd_backend_free(be_ref);
    kvd_backend_free(be_fast1);
    kvd_backend_free(be_fastN);
    return tu_report("kernels_convert_quant");
}
