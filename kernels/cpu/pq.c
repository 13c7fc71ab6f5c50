/*
 * PQ index on the CPU: train, encode, top-k search (scalar reference, AVX2
 * scan), checked wrappers and the backend's pq table. Semantics and layouts
 * are in kvdepot/pq.h.
 *
 * The fast search:
 *   - lookup table: the reference formula, vectorised across 8 centroids
 *     (gathered with stride dsub) with the same per-entry summation order,
 *     so the table is bitwise the reference table;
 *   - scan: 8 tokens per step. The codes of 8 rows are loaded and transposed
 *     in registers (m = 1, 2, 4, 8, 16 have their own shuffles; other
 *     multiples of 4 use dword gathers), every sub-space's 8 table entries
 *     are fetched with one gather and added in sub-space order, which gives
 *     bitwise the reference score;
 *   - top-k: no heap. A token enters a small buffer only when its score
 *     beats the running threshold (the k-th best key seen so far); when the
 *     buffer fills it is cut back to its k best by quickselect and the
 *     threshold rises. After the first few thousand tokens almost every
 *     token fails the single vector compare, which is what makes k = 2048
 *     nearly as cheap as k = 256. For long ranges the threshold starts from
 *     an estimate taken on a sample (guess_threshold), checked afterwards;
 *   - on CPUs with AVX-512 VBMI (chosen at run time), long ranges with a
 *     starting threshold are scanned 64 tokens at a time on 8-bit quantized
 *     tables, and only tokens whose upper bound beats the threshold are
 *     scored exactly (scan_vbmi; 4-bit codes are looked up where they lie,
 *     four sub-spaces to a register table, scan_vbmi4_m); the AVX2 scan is the
 *     path everywhere else;
 *   - m <= 2 with 4-bit codes: whether a token beats the threshold is looked
 *     up exactly in a 16 x 16 bit table of its codes (pk_pass2; rows and
 *     packed codes), so only tokens that beat it are scored;
 *   - 4-bit codes packed in blocks of 32 tokens (kvd_pq_pack4) are scanned
 *     as they lie, two sub-spaces a 32-byte load, their nibbles looked up in
 *     16-entry tables held in registers (scan_packed4; with AVX-512BW four
 *     sub-spaces a 64-byte load, scan_packed4_512), with the same
 *     quantized bound and exact re-scoring;
 *   - threads split the middle tokens into contiguous ranges, each with its
 *     own buffer; the per-thread winners are merged by one more selection.
 *     Selection is exact, so the result does not depend on the split.
 *
 * Ordering keys: a (score, index) pair is packed into a u64 whose unsigned
 * order is the result order: high 32 bits = the score mapped to an
 * order-preserving u32 (NaN -> 0, below every number; -0 -> +0), low 32 bits
 * = ~index, so among equal scores the lower index has the larger key. All
 * keys are distinct, "best first" is "largest key first".
 */
#include <immintrin.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/cpu_internal.h"
#include "kvdepot/pq.h"

/* ---- ordering keys and selection --------------------------------------- */

static inline uint32_t key_ord(float s)
{
    if (isnan(s))
        return 0;
    if (s == 0.0f)
        s = 0.0f;
    uint32_t u;
    memcpy(&u, &s, 4);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

static inline float key_unord(uint32_t o)
{
    uint32_t u = (o & 0x80000000u) ? (o & 0x7FFFFFFFu) : ~o;
    float s;
    memcpy(&s, &u, 4);
    return s;
}

static inline uint64_t make_key(float s, uint32_t idx)
{
    return ((uint64_t)key_ord(s) << 32) | (uint64_t)(~idx);
}

static inline uint32_t key_idx(uint64_t key) { return ~(uint32_t)key; }
static inline float key_score(uint64_t key) { return key_unord((uint32_t)(key >> 32)); }

static inline void swap_u64(uint64_t *a, uint64_t *b)
{
    uint64_t t = *a;
    *a = *b;
    *b = t;
}

/* Descending insertion sort of keys[0..n). */
static void insertion_desc(uint64_t *keys, int64_t n)
{
    for (int64_t i = 1; i < n; i++) {
        uint64_t v = keys[i];
        int64_t j = i - 1;
        while (j >= 0 && keys[j] < v) {
            keys[j + 1] = keys[j];
            j--;
        }
        keys[j + 1] = v;
    }
}

/* Move the k largest keys to keys[0..k), the k-th largest to keys[k-1].
 * 1 <= k <= n; keys are distinct (quickselect, median-of-three pivots). */
static void select_topk(uint64_t *keys, int64_t n, int64_t k)
{
    int64_t lo = 0, hi = n - 1, target = k - 1;
    while (hi > lo) {
        if (hi - lo < 16) {
            insertion_desc(keys + lo, hi - lo + 1);
            return;
        }
        int64_t mid = lo + (hi - lo) / 2;
        if (keys[mid] > keys[lo])
            swap_u64(&keys[mid], &keys[lo]);
        if (keys[hi] > keys[lo])
            swap_u64(&keys[hi], &keys[lo]);
        if (keys[hi] > keys[mid])
            swap_u64(&keys[hi], &keys[mid]);
        /* now keys[lo] >= keys[mid] >= keys[hi]; pivot = median */
        uint64_t pivot = keys[mid];
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (keys[i] > pivot)
                i++;
            while (keys[j] < pivot)
                j--;
            if (i <= j) {
                swap_u64(&keys[i], &keys[j]);
                i++;
                j--;
            }
        }
        if (target <= j)
            hi = j;
        else if (target >= i)
            lo = i;
        else
            return;
    }
}

/* Sort keys[0..n) largest first by LSD radix passes (8 bits each) over
 * bits [lo, lo + 32) of the complemented keys; the counts of every pass are
 * taken in one read, and passes where every key has the same byte are
 * skipped. tmp holds n keys. */
static void radix_desc(uint64_t *keys, int64_t n, uint64_t *tmp, int lo)
{
    int64_t cnts[4][256];
    memset(cnts, 0, sizeof cnts);
    for (int64_t i = 0; i < n; i++) {
        const uint32_t x = (uint32_t)(~keys[i] >> lo);
        for (int pass = 0; pass < 4; pass++)
            cnts[pass][(x >> (pass * 8)) & 0xFF]++;
    }
    uint64_t *src = keys, *dst = tmp;
    for (int pass = 0; pass < 4; pass++) {
        const int shift = lo + pass * 8;
        int64_t *cnt = cnts[pass];
        if (cnt[(~src[0] >> shift) & 0xFF] == n) /* every key has this byte */
            continue;
        int64_t pos = 0;
        for (int b = 0; b < 256; b++) {
            int64_t c = cnt[b];
            cnt[b] = pos;
            pos += c;
        }
        for (int64_t i = 0; i < n; i++)
            dst[cnt[(~src[i] >> shift) & 0xFF]++] = src[i];
        uint64_t *t = src;
        src = dst;
        dst = t;
    }
    if (src != keys)
        memcpy(keys, src, sizeof(uint64_t) * (size_t)n);
}

/* Sort keys largest first: radix passes over the score halves (the high 32
 * bits); then each run of equal scores is put in token order, by insertion,
 * or by radix passes over the token halves for the long runs (few distinct
 * scores when m and b are small: the ties of a large k, or the reference's
 * sort of every token). The token halves get no passes over all keys: they
 * would double the passes for the few ties of a top-k. */
static void sort_desc(uint64_t *keys, int64_t n, uint64_t *tmp)
{
    if (n < 64) {
        insertion_desc(keys, n);
        return;
    }
    radix_desc(keys, n, tmp, 32);
    for (int64_t i = 0; i < n;) {
        int64_t e = i + 1;
        while (e < n && keys[e] >> 32 == keys[i] >> 32)
            e++;
        if (e - i > 64)
            radix_desc(keys + i, e - i, tmp, 0);
        else if (e - i > 1)
            insertion_desc(keys + i, e - i);
        i = e;
    }
}

/* Candidate buffer with a running threshold. thr is NaN until the k-th best
 * key is a number; the scan's test !(score <= thr) then admits everything. */
typedef struct topk_buf {
    uint64_t *keys;
    int64_t n, cap, k;
    float thr;
    uint64_t steps, rescored; /* quantized scans (kvd__pq_counters) */
    /* candidates of the quantized scans waiting to be re-scored four at a
     * time (rescore; at most 3 between calls, tb_flush scores the rest) */
    int np;
    const uint8_t *prow[4];
    uint32_t ptok[4];
} topk_buf;

static uint64_t pq_counters[3]; /* kvd__pq_counters, updated atomically */

int64_t kvd__pq_thread_bytes = 4 << 20;

void kvd__pq_counters_get(kvd__pq_counters *out)
{
    out->steps = __atomic_load_n(&pq_counters[0], __ATOMIC_RELAXED);
    out->rescored = __atomic_load_n(&pq_counters[1], __ATOMIC_RELAXED);
    out->rescans = __atomic_load_n(&pq_counters[2], __ATOMIC_RELAXED);
}

static void tb_compact(topk_buf *tb)
{
    if (tb->n <= tb->k)
        return;
    select_topk(tb->keys, tb->n, tb->k);
    tb->n = tb->k;
    uint64_t kth = tb->keys[tb->k - 1];
    if ((kth >> 32) != 0)
        tb->thr = key_score(kth);
}

static inline void tb_push(topk_buf *tb, float s, uint32_t idx)
{
    tb->keys[tb->n++] = make_key(s, idx);
}

/* ---- lookup tables ----------------------------------------------------- */

void kvd_pq_lut_ref(int m, int b, int D, const float *centroids, const float *q, float *lut)
{
    const int ksub = 1 << b, dsub = D / m;
    for (int j = 0; j < m; j++) {
        const float *qj = q + j * dsub;
        for (int c = 0; c < 256; c++) {
            if (c >= ksub) {
                lut[j * 256 + c] = -INFINITY;
                continue;
            }
            const float *cc = centroids + ((int64_t)j * ksub + c) * dsub;
            float acc = 0.0f;
            for (int t = 0; t < dsub; t++)
                acc = acc + qj[t] * cc[t];
            lut[j * 256 + c] = acc;
        }
    }
}

/* Same bits as kvd_pq_lut_ref: 8 centroids at a time, one lane each, the
 * sum over t in the reference's order. Rows of 8 centroids are loaded 8
 * floats at a time and transposed in registers (dsub % 8 == 0), otherwise
 * gathered with stride dsub. */
__attribute__((target("avx2,fma"))) static void lut_avx2(int m, int b, int D,
                                                         const float *centroids, const float *q,
                                                         float *lut)
{
    const int ksub = 1 << b, dsub = D / m;
    const __m256i off = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                           _mm256_set1_epi32(dsub));
    for (int j = 0; j < m; j++) {
        const float *qj = q + j * dsub;
        const float *cj = centroids + (int64_t)j * ksub * dsub;
        for (int c = 0; c < ksub; c += 8) {
            const float *c0 = cj + (int64_t)c * dsub;
            __m256 acc = _mm256_setzero_ps();
            if (dsub % 8 == 0) {
                for (int t0 = 0; t0 < dsub; t0 += 8) {
                    __m256 r0 = _mm256_loadu_ps(c0 + 0 * dsub + t0);
                    __m256 r1 = _mm256_loadu_ps(c0 + 1 * dsub + t0);
                    __m256 r2 = _mm256_loadu_ps(c0 + 2 * dsub + t0);
                    __m256 r3 = _mm256_loadu_ps(c0 + 3 * dsub + t0);
                    __m256 r4 = _mm256_loadu_ps(c0 + 4 * dsub + t0);
                    __m256 r5 = _mm256_loadu_ps(c0 + 5 * dsub + t0);
                    __m256 r6 = _mm256_loadu_ps(c0 + 6 * dsub + t0);
                    __m256 r7 = _mm256_loadu_ps(c0 + 7 * dsub + t0);
                    __m256 u0 = _mm256_unpacklo_ps(r0, r1), u1 = _mm256_unpackhi_ps(r0, r1);
                    __m256 u2 = _mm256_unpacklo_ps(r2, r3), u3 = _mm256_unpackhi_ps(r2, r3);
                    __m256 u4 = _mm256_unpacklo_ps(r4, r5), u5 = _mm256_unpackhi_ps(r4, r5);
                    __m256 u6 = _mm256_unpacklo_ps(r6, r7), u7 = _mm256_unpackhi_ps(r6, r7);
                    __m256 v0 = _mm256_shuffle_ps(u0, u2, _MM_SHUFFLE(1, 0, 1, 0));
                    __m256 v1 = _mm256_shuffle_ps(u0, u2, _MM_SHUFFLE(3, 2, 3, 2));
                    __m256 v2 = _mm256_shuffle_ps(u1, u3, _MM_SHUFFLE(1, 0, 1, 0));
                    __m256 v3 = _mm256_shuffle_ps(u1, u3, _MM_SHUFFLE(3, 2, 3, 2));
                    __m256 v4 = _mm256_shuffle_ps(u4, u6, _MM_SHUFFLE(1, 0, 1, 0));
                    __m256 v5 = _mm256_shuffle_ps(u4, u6, _MM_SHUFFLE(3, 2, 3, 2));
                    __m256 v6 = _mm256_shuffle_ps(u5, u7, _MM_SHUFFLE(1, 0, 1, 0));
                    __m256 v7 = _mm256_shuffle_ps(u5, u7, _MM_SHUFFLE(3, 2, 3, 2));
                    /* column t (lanes = the 8 centroids) */
                    __m256 col[8] = {
                        _mm256_permute2f128_ps(v0, v4, 0x20), _mm256_permute2f128_ps(v1, v5, 0x20),
                        _mm256_permute2f128_ps(v2, v6, 0x20), _mm256_permute2f128_ps(v3, v7, 0x20),
                        _mm256_permute2f128_ps(v0, v4, 0x31), _mm256_permute2f128_ps(v1, v5, 0x31),
                        _mm256_permute2f128_ps(v2, v6, 0x31), _mm256_permute2f128_ps(v3, v7, 0x31),
                    };
                    for (int t = 0; t < 8; t++)
                        acc = _mm256_add_ps(acc,
                                            _mm256_mul_ps(_mm256_broadcast_ss(qj + t0 + t), col[t]));
                }
            } else {
                for (int t = 0; t < dsub; t++)
                    acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_broadcast_ss(qj + t),
                                                           _mm256_i32gather_ps(c0 + t, off, 4)));
            }
            _mm256_storeu_ps(lut + j * 256 + c, acc);
        }
        for (int c = ksub; c < 256; c++)
            lut[j * 256 + c] = -INFINITY;
    }
}

/* qbar = q_0 + ... + q_{G-1}, in that order. */
static void sum_queries(int G, int D, const float *q, float *qbar)
{
    for (int t = 0; t < D; t++) {
        float s = q[t];
        for (int h = 1; h < G; h++)
            s = s + q[(int64_t)h * D + t];
        qbar[t] = s;
    }
}

/* ---- packed 4-bit codes ------------------------------------------------ */

int64_t kvd_pq_packed4_bytes(int64_t n, int m)
{
    if (n <= 0 || m <= 0)
        return 0;
    return (n + 31) / 32 * 16 * (int64_t)(m + (m & 1));
}

/* Code j of token t (>= 0) lies at byte pk_off + 16 j of the packed codes
 * (block t / 32, the sub-spaces' 16 bytes one after the other, byte t % 16),
 * in the nibble at bit *sh: 4 for t % 32 >= 16. Shifts, not divisions. */
static inline uint64_t pk_off(int m, int64_t t, int *sh)
{
    const uint64_t u = (uint64_t)t;
    *sh = (int)(u >> 2 & 4);
    return (u >> 5) * 16 * (uint64_t)(m + (m & 1)) + (u & 15);
}

void kvd_pq_pack4(int64_t n, int m, const uint8_t *codes, uint8_t *packed)
{
    memset(packed, 0, (size_t)kvd_pq_packed4_bytes(n, m));
    for (int64_t i = 0; i < n; i++) {
        int sh;
        uint8_t *blk = packed + pk_off(m, i, &sh);
        for (int j = 0; j < m; j++)
            blk[16 * j] |= (uint8_t)((codes[i * m + j] & 15) << sh);
    }
}

static void unpack4_row(const uint8_t *packed, int m, int64_t i, uint8_t *row)
{
    int sh;
    const uint8_t *blk = packed + pk_off(m, i, &sh);
    for (int j = 0; j < m; j++)
        row[j] = (uint8_t)((blk[16 * j] >> sh) & 15);
}

/* Where a search reads its codes: rows (n, m), or packed 4-bit blocks
 * (m <= 16) unpacked a row at a time into a caller's 16 bytes. */
typedef struct code_src {
    const uint8_t *rows, *packed;
    int m;
} code_src;

static inline const uint8_t *src_row(const code_src *src, int64_t i, uint8_t *buf)
{
    if (src->rows)
        return src->rows + i * src->m;
    unpack4_row(src->packed, src->m, i, buf);
    return buf;
}

/* ---- scores ------------------------------------------------------------ */

/* score_one of packed token t. */
__attribute__((target("avx2,fma"), always_inline)) static inline float
score_packed1(int m, const uint8_t *packed, int64_t t, const float *lut)
{
    int sh;
    const uint8_t *bp = packed + pk_off(m, t, &sh);
    float s = lut[(bp[0] >> sh) & 15];
    for (int j = 1; j < m; j++)
        s = s + lut[j * 256 + ((bp[16 * j] >> sh) & 15)];
    return s;
}

/* Exact scores of the packed tokens tok[0..7], eight chains of adds
 * interleaved (each is score_one's sum in sub-space order), in named
 * variables so that the sums stay in registers. */
__attribute__((target("avx2,fma"), always_inline)) static inline void
score_packed8(int m, const uint8_t *packed, const int64_t *tok, const float *lut, float *out)
{
#define PK_LANE(l)                                                                                 \
    int h##l;                                                                                      \
    const uint8_t *b##l = packed + pk_off(m, tok[l], &h##l);                                       \
    float s##l = lut[(b##l[0] >> h##l) & 15]
    PK_LANE(0);
    PK_LANE(1);
    PK_LANE(2);
    PK_LANE(3);
    PK_LANE(4);
    PK_LANE(5);
    PK_LANE(6);
    PK_LANE(7);
#undef PK_LANE
    for (int j = 1; j < m; j++) {
        const float *t = lut + j * 256;
        const int o = 16 * j;
        s0 = s0 + t[(b0[o] >> h0) & 15];
        s1 = s1 + t[(b1[o] >> h1) & 15];
        s2 = s2 + t[(b2[o] >> h2) & 15];
        s3 = s3 + t[(b3[o] >> h3) & 15];
        s4 = s4 + t[(b4[o] >> h4) & 15];
        s5 = s5 + t[(b5[o] >> h5) & 15];
        s6 = s6 + t[(b6[o] >> h6) & 15];
        s7 = s7 + t[(b7[o] >> h7) & 15];
    }
    out[0] = s0;
    out[1] = s1;
    out[2] = s2;
    out[3] = s3;
    out[4] = s4;
    out[5] = s5;
    out[6] = s6;
    out[7] = s7;
}

/* score_one of the packed tokens tok[0..n). */
__attribute__((target("avx2,fma"))) static void score_packed_n(int m, const uint8_t *packed,
                                                               const int64_t *tok, int64_t n,
                                                               const float *lut, float *out)
{
    const int64_t n8 = n / 8 * 8;
    for (int64_t i = 0; i < n8; i += 8)
        score_packed8(m, packed, tok + i, lut, out + i);
    for (int64_t i = n8; i < n; i++)
        out[i] = score_packed1(m, packed, tok[i], lut);
}

static inline float score_one(int m, const uint8_t *code, const float *lut)
{
    float s = lut[code[0]];
    for (int j = 1; j < m; j++)
        s = s + lut[j * 256 + code[j]];
    return s;
}

/* KVD_PQ_AGG_MAX: the largest per-head score; NaN heads are skipped unless
 * all are NaN. */
static inline float score_max(int m, int G, const uint8_t *code, const float *luts)
{
    float best = score_one(m, code, luts);
    for (int h = 1; h < G; h++) {
        float v = score_one(m, code, luts + (int64_t)h * m * 256);
        if (isnan(best) || v > best)
            best = v;
    }
    return best;
}

static inline float score_agg(int m, int G, kvd_pq_agg agg, const uint8_t *code,
                              const float *luts)
{
    return agg == KVD_PQ_AGG_MAX ? score_max(m, G, code, luts) : score_one(m, code, luts);
}

/* score_one of the four rows r[0..3], the four sums interleaved (each is a
 * chain of dependent adds; four at once keep the adder busy). */
static inline void score_four(int m, const uint8_t *const r[4], const float *lut, float out[4])
{
    float s0 = lut[r[0][0]], s1 = lut[r[1][0]], s2 = lut[r[2][0]], s3 = lut[r[3][0]];
    for (int j = 1; j < m; j++) {
        s0 = s0 + lut[j * 256 + r[0][j]];
        s1 = s1 + lut[j * 256 + r[1][j]];
        s2 = s2 + lut[j * 256 + r[2][j]];
        s3 = s3 + lut[j * 256 + r[3][j]];
    }
    out[0] = s0;
    out[1] = s1;
    out[2] = s2;
    out[3] = s3;
}

/* Tables for a search: SUM -> one table of qbar; MAX -> G tables. */
static int build_luts(int simd, int m, int b, int D, const float *centroids, int G,
                      const float *queries, kvd_pq_agg agg, float **out)
{
    int ntab = agg == KVD_PQ_AGG_MAX ? G : 1;
    float *luts = malloc(sizeof(float) * (size_t)ntab * (size_t)m * 256);
    float *qbar = malloc(sizeof(float) * (size_t)D);
    if (!luts || !qbar) {
        free(luts);
        free(qbar);
        return KVD_ENOMEM;
    }
    for (int h = 0; h < ntab; h++) {
        const float *q = queries + (int64_t)h * D;
        if (agg != KVD_PQ_AGG_MAX) {
            sum_queries(G, D, queries, qbar);
            q = qbar;
        }
        if (simd)
            lut_avx2(m, b, D, centroids, q, luts + (int64_t)h * m * 256);
        else
            kvd_pq_lut_ref(m, b, D, centroids, q, luts + (int64_t)h * m * 256);
    }
    free(qbar);
    *out = luts;
    return KVD_OK;
}

int64_t kvd_pq_search_count(int64_t n, const kvd_pq_search_params *p)
{
    if (n <= 0 || !p)
        return 0;
    int64_t s = p->sink < n ? (p->sink > 0 ? p->sink : 0) : n;
    int64_t w = p->window < n - s ? (p->window > 0 ? p->window : 0) : n - s;
    int64_t mid = n - s - w;
    int64_t k = p->k > 0 ? p->k : 0;
    return s + w + (k < mid ? k : mid);
}

/* Forced tokens + the middle's winners -> sorted output. mid holds nmid keys
 * (already cut to k). */
static int finish(int64_t n, int m, int G, kvd_pq_agg agg, const code_src *src, const float *luts,
                  const kvd_pq_search_params *p, const uint64_t *mid, int64_t nmid, uint32_t *idx,
                  float *scores, int64_t *nout)
{
    int64_t s = p->sink < n ? (p->sink > 0 ? p->sink : 0) : n;
    int64_t w = p->window < n - s ? (p->window > 0 ? p->window : 0) : n - s;
    int64_t total = s + w + nmid;
    uint64_t *all = malloc(sizeof(uint64_t) * (size_t)(total > 0 ? total : 1) * 2);
    if (!all)
        return KVD_ENOMEM;
    int64_t c = 0;
    uint8_t rb[16];
    for (int64_t i = 0; i < s; i++)
        all[c++] = make_key(score_agg(m, G, agg, src_row(src, i, rb), luts), (uint32_t)i);
    for (int64_t i = n - w; i < n; i++)
        all[c++] = make_key(score_agg(m, G, agg, src_row(src, i, rb), luts), (uint32_t)i);
    memcpy(all + c, mid, sizeof(uint64_t) * (size_t)nmid);
    c += nmid;
    sort_desc(all, c, all + total);
    for (int64_t i = 0; i < c; i++) {
        idx[i] = key_idx(all[i]);
        if (scores)
            scores[i] = key_score(all[i]);
    }
    *nout = c;
    free(all);
    return KVD_OK;
}

/* ---- reference search -------------------------------------------------- */

int kvd_pq_search_ref(int64_t n, int m, int b, int D, const float *centroids,
                      const uint8_t *codes, int G, const float *queries,
                      const kvd_pq_search_params *p, uint32_t *idx, float *scores,
                      int64_t *nout)
{
    *nout = 0;
    float *luts = NULL;
    int rc = build_luts(0, m, b, D, centroids, G, queries, p->agg, &luts);
    if (rc)
        return rc;
    int64_t s = p->sink < n ? (p->sink > 0 ? p->sink : 0) : n;
    int64_t w = p->window < n - s ? (p->window > 0 ? p->window : 0) : n - s;
    int64_t lo = s, hi = n - w, nm = hi - lo;
    int64_t k = p->k > 0 ? (p->k < nm ? p->k : nm) : 0;
    uint64_t *keys = malloc(sizeof(uint64_t) * (size_t)(nm > 0 ? nm : 1) * 2);
    if (!keys) {
        free(luts);
        return KVD_ENOMEM;
    }
    /* every middle token's score, all sorted, the first k kept */
    for (int64_t i = lo; i < hi; i++)
        keys[i - lo] = make_key(score_agg(m, G, p->agg, codes + i * m, luts), (uint32_t)i);
    sort_desc(keys, nm, keys + nm);
    const code_src src = {codes, NULL, m};
    rc = finish(n, m, G, p->agg, &src, luts, p, keys, k, idx, scores, nout);
    free(keys);
    free(luts);
    return rc;
}

/* ---- fast scan --------------------------------------------------------- */

/* Scalar scan of tokens [i0, i1) into tb (exact scores, threshold test). */
static void scan_scalar(int m, int G, kvd_pq_agg agg, const uint8_t *codes, const float *luts,
                        int64_t i0, int64_t i1, topk_buf *tb)
{
    for (int64_t i = i0; i < i1; i++) {
        float sc = score_agg(m, G, agg, codes + i * m, luts);
        if (!(sc <= tb->thr)) {
            if (tb->n == tb->cap)
                tb_compact(tb);
            tb_push(tb, sc, (uint32_t)i);
        }
    }
}

#define G8(lut, j, ix) _mm256_i32gather_ps((lut) + (j) * 256, (ix), 4)

/* acc (+)= the 4 sub-spaces whose codes are the 4 bytes of each dword of v. */
__attribute__((target("avx2,fma"), always_inline)) static inline __m256
add4(__m256 acc, __m256i v, const float *lut, int j0, int first)
{
    const __m256i ff = _mm256_set1_epi32(0xFF);
    __m256i x0 = _mm256_and_si256(v, ff);
    __m256i x1 = _mm256_and_si256(_mm256_srli_epi32(v, 8), ff);
    __m256i x2 = _mm256_and_si256(_mm256_srli_epi32(v, 16), ff);
    __m256i x3 = _mm256_srli_epi32(v, 24);
    acc = first ? G8(lut, j0, x0) : _mm256_add_ps(acc, G8(lut, j0, x0));
    acc = _mm256_add_ps(acc, G8(lut, j0 + 1, x1));
    acc = _mm256_add_ps(acc, G8(lut, j0 + 2, x2));
    acc = _mm256_add_ps(acc, G8(lut, j0 + 3, x3));
    return acc;
}

/* Scores of the 8 tokens whose code rows start at p (M sub-spaces). */
__attribute__((target("avx2,fma"), always_inline)) static inline __m256
score8(const uint8_t *p, int M, const float *lut)
{
    __m256 acc = _mm256_setzero_ps();
    if (M == 1) {
        __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
        acc = G8(lut, 0, x);
    } else if (M == 2) {
        const __m128i sh = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
        __m128i v = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)p), sh);
        __m256i x0 = _mm256_cvtepu8_epi32(v);
        __m256i x1 = _mm256_cvtepu8_epi32(_mm_srli_si128(v, 8));
        acc = _mm256_add_ps(G8(lut, 0, x0), G8(lut, 1, x1));
    } else if (M == 4) {
        acc = add4(acc, _mm256_loadu_si256((const __m256i *)p), lut, 0, 1);
    } else if (M == 8) {
        __m256 a = _mm256_castsi256_ps(_mm256_loadu_si256((const __m256i *)p));
        __m256 b = _mm256_castsi256_ps(_mm256_loadu_si256((const __m256i *)(p + 32)));
        /* dwords in token order 0,1,4,5 | 2,3,6,7; permute4x64 restores 0..7 */
        __m256i lo = _mm256_castps_si256(_mm256_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0)));
        __m256i hi = _mm256_castps_si256(_mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
        lo = _mm256_permute4x64_epi64(lo, _MM_SHUFFLE(3, 1, 2, 0));
        hi = _mm256_permute4x64_epi64(hi, _MM_SHUFFLE(3, 1, 2, 0));
        acc = add4(acc, lo, lut, 0, 1);
        acc = add4(acc, hi, lut, 4, 0);
    } else if (M == 16) {
        __m256i x0 = _mm256_loadu_si256((const __m256i *)p);        /* t0 | t1 */
        __m256i x1 = _mm256_loadu_si256((const __m256i *)(p + 32)); /* t2 | t3 */
        __m256i x2 = _mm256_loadu_si256((const __m256i *)(p + 64)); /* t4 | t5 */
        __m256i x3 = _mm256_loadu_si256((const __m256i *)(p + 96)); /* t6 | t7 */
        __m256i u01 = _mm256_unpacklo_epi32(x0, x1), v01 = _mm256_unpackhi_epi32(x0, x1);
        __m256i u23 = _mm256_unpacklo_epi32(x2, x3), v23 = _mm256_unpackhi_epi32(x2, x3);
        /* token order in every r: 0,2,4,6 | 1,3,5,7 (fixed on the sum) */
        acc = add4(acc, _mm256_unpacklo_epi64(u01, u23), lut, 0, 1);
        acc = add4(acc, _mm256_unpackhi_epi64(u01, u23), lut, 4, 0);
        acc = add4(acc, _mm256_unpacklo_epi64(v01, v23), lut, 8, 0);
        acc = add4(acc, _mm256_unpackhi_epi64(v01, v23), lut, 12, 0);
        acc = _mm256_permutevar8x32_ps(acc, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    } else { /* any other multiple of 4: dword gathers straight from the rows */
        const __m256i off = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                               _mm256_set1_epi32(M));
        for (int g = 0; g < M; g += 4) {
            __m256i v = _mm256_i32gather_epi32((const int *)(p + g), off, 1);
            acc = add4(acc, v, lut, g, g == 0);
        }
    }
    return acc;
}

__attribute__((target("avx2,fma"), always_inline)) static inline void
scan_avx2_m(int M, const uint8_t *codes, const float *lut, int64_t i0, int64_t i1, topk_buf *tb)
{
    int64_t i = i0;
    __m256 thr = _mm256_set1_ps(tb->thr);
    float tmp[8];
    for (; i + 8 <= i1; i += 8) {
        __m256 sc = score8(codes + i * M, M, lut);
        int mask = _mm256_movemask_ps(_mm256_cmp_ps(sc, thr, _CMP_NLE_UQ));
        if (__builtin_expect(mask != 0, 0)) {
            if (tb->n + 8 > tb->cap) {
                tb_compact(tb);
                thr = _mm256_set1_ps(tb->thr);
                mask = _mm256_movemask_ps(_mm256_cmp_ps(sc, thr, _CMP_NLE_UQ));
            }
            _mm256_storeu_ps(tmp, sc);
            while (mask) {
                int l = __builtin_ctz((unsigned)mask);
                tb_push(tb, tmp[l], (uint32_t)(i + l));
                mask &= mask - 1;
            }
        }
    }
    scan_scalar(M, 1, KVD_PQ_AGG_SUM, codes, lut, i, i1, tb);
}

__attribute__((target("avx2,fma"))) static void scan_avx2(int m, const uint8_t *codes,
                                                          const float *lut, int64_t i0,
                                                          int64_t i1, topk_buf *tb)
{
    switch (m) {
    case 1: scan_avx2_m(1, codes, lut, i0, i1, tb); break;
    case 2: scan_avx2_m(2, codes, lut, i0, i1, tb); break;
    case 4: scan_avx2_m(4, codes, lut, i0, i1, tb); break;
    case 8: scan_avx2_m(8, codes, lut, i0, i1, tb); break;
    case 16: scan_avx2_m(16, codes, lut, i0, i1, tb); break;
    default: scan_avx2_m(m, codes, lut, i0, i1, tb); break;
    }
}

/*
 * Starting threshold for the scan, from the exact scores of a strided sample
 * of S middle tokens (1024, or one in 16 of fewer than 16K, at least 128):
 * the sample's r-th best, with r = e + 3.5 sqrt(e) + 4
 * where e = k * S / nm sample tokens are expected above the true k-th
 * best (a guess too high is then a ~1-in-5000 event). Starting there, only
 * about k + 3.5 sqrt(k n / S) tokens enter the buffer whatever the order
 * of the scores (a rising trend along positions would otherwise push nearly
 * every token). The guess is only a filter: the caller checks that at least
 * k tokens passed it and rescans from scratch otherwise. NaN = no guess.
 */
static float guess_threshold(int m, int G, kvd_pq_agg agg, const code_src *src, const float *luts,
                             int64_t lo, int64_t nm, int64_t k)
{
    enum { SMAX = 1024 };
    const int64_t S = nm >= 16 * SMAX ? SMAX : (nm / 16) & ~(int64_t)3; /* 4 scored a step */
    if (S < 128)
        return NAN;
    double e = (double)S * (double)k / (double)nm;
    int64_t r = (int64_t)ceil(e + 3.5 * sqrt(e) + 4.0);
    if (r > S / 2)
        return NAN;
    uint64_t keys[SMAX];
    int64_t step = nm / S;
    if (src->packed) {
        int64_t t[SMAX];
        float sc[SMAX];
        for (int64_t i = 0; i < S; i++)
            t[i] = lo + i * step + step / 2;
        score_packed_n(m, src->packed, t, S, luts, sc);
        for (int64_t i = 0; i < S; i++)
            keys[i] = make_key(sc[i], (uint32_t)t[i]);
    } else {
        for (int64_t i = 0; i < S; i += 4) {
            int64_t t[4];
            const uint8_t *rows[4];
            for (int l = 0; l < 4; l++) {
                t[l] = lo + (i + l) * step + step / 2;
                rows[l] = src->rows + t[l] * m;
            }
            float sc[4];
            if (agg == KVD_PQ_AGG_MAX)
                for (int l = 0; l < 4; l++)
                    sc[l] = score_max(m, G, rows[l], luts);
            else
                score_four(m, rows, luts, sc);
            for (int l = 0; l < 4; l++)
                keys[i + l] = make_key(sc[l], (uint32_t)t[l]);
        }
    }
    select_topk(keys, S, r);
    if ((keys[r - 1] >> 32) == 0)
        return NAN;
    /* just below the guess, so tokens tied with it pass the strict test:
     * with few distinct scores (small m and b) whole runs of ties sit there */
    return nextafterf(key_score(keys[r - 1]), -INFINITY);
}

/*
 * AVX-512 VBMI scan for m in {2, 4, 8, 16}: 64 tokens per step on 8-bit
 * quantized tables, exact scores only for the tokens whose bound can beat
 * the threshold.
 *
 * Quantized tables: qlut[j][c] = floor((LUT[j][c] - min_j) / delta), u8,
 * delta = (largest per-sub-space range) / 255. For Q = sum_j qlut[j][code_j]
 * the exact float score s obeys
 *     s <= base + delta * (Q + m) + eps,   base = sum_j min_j,
 * (+1 per sub-space for the floor; eps covers the float summation error,
 * 2 m^2 2^-24 max|LUT|, and the rounding of the double product that gave
 * the floor, m delta 1e-6). A token is
 * re-scored exactly, with the reference's arithmetic, only when that bound
 * exceeds the current threshold; every other token has s <= thr and the
 * threshold scan would have dropped it too, so results stay exact.
 *
 * Codes arrive as rows (n, m); a step loads 64 rows (m zmm registers), groups
 * each register's bytes by sub-space (vpermb), and transposes the m x m
 * matrix of (64/m)-byte elements across the registers by block swaps, after
 * which register j holds code j of the 64 tokens in token order. The 256-entry
 * byte table lookup is two vpermi2b (entries 0-127, 128-255) and a blend on
 * bit 7; sums go to u16 lanes (<= 16 * 255). Within a step the threshold is
 * fixed (the buffer is made room for first), so the order in which a step's
 * candidates are pushed does not matter.
 */
typedef struct pq_qlut {
    uint8_t q[16][256]; /* quantized tables, m <= 16 */
    /* b = 4: the same entries 16 to a sub-space, four sub-spaces to a
     * 64-byte table: nib[t][16 * s + c] = q[4 t + s][c] */
    uint8_t nib[4][64];
    double base, delta, eps;
    int m, b;
} pq_qlut;

#define VBMI_TARGET __attribute__((target("avx512f,avx512bw,avx512vbmi,avx2,fma,bmi2")))

/* 0 when the tables cannot be quantized (non-finite entries, m > 16).
 * (Compiled for AVX2, which every machine that uses it has, so floor() is
 * one instruction.) */
__attribute__((target("avx2,fma"))) static int build_qlut(int m, int b, const float *lut,
                                                          pq_qlut *ql)
{
    if (m > 16)
        return 0;
    const int ksub = 1 << b;
    double range = 0, base = 0, amax = 0;
    double mins[16];
    for (int j = 0; j < m; j++) {
        double lo = INFINITY, hi = -INFINITY;
        for (int c = 0; c < ksub; c++) {
            double v = lut[j * 256 + c];
            if (!isfinite(v))
                return 0;
            lo = v < lo ? v : lo;
            hi = v > hi ? v : hi;
            amax = fabs(v) > amax ? fabs(v) : amax;
        }
        mins[j] = lo;
        base += lo;
        range = hi - lo > range ? hi - lo : range;
    }
    double delta = range > 0 ? range / 255.0 : 1.0, inv = 1.0 / delta;
    for (int j = 0; j < m; j++) {
        for (int c = 0; c < ksub; c++) {
            double f = floor((lut[j * 256 + c] - mins[j]) * inv);
            ql->q[j][c] = (uint8_t)(f < 0 ? 0 : f > 255 ? 255 : f);
        }
        memset(ql->q[j] + ksub, 0, (size_t)(256 - ksub));
    }
    memset(ql->nib, 0, sizeof ql->nib);
    if (b == 4)
        for (int j = 0; j < m; j++)
            memcpy(ql->nib[j / 4] + 16 * (j % 4), ql->q[j], 16);
    ql->base = base;
    ql->delta = delta;
    ql->eps = 2.0 * m * m * ldexp(1.0, -24) * amax + m * delta * 1e-6 + 1e-30;
    ql->m = m;
    ql->b = b;
    return 1;
}

/* Largest Q whose bound does not exceed thr (tokens with Q above it are
 * candidates); -1 = every token is one. */
static int qlut_threshold(const pq_qlut *ql, float thr)
{
    double x = floor(((double)thr - ql->base - ql->eps) / ql->delta) - (double)ql->m;
    if (!(x >= -1.0))
        return -1;
    return x > 32767.0 ? 32767 : (int)x;
}

static int has_avx512bw(void)
{
    return kvd__cpu_has(KVD__CPU_AVX512F | KVD__CPU_AVX512BW);
}

static int has_vbmi(void)
{
    return kvd__cpu_has(KVD__CPU_AVX512F | KVD__CPU_AVX512BW | KVD__CPU_AVX512VBMI | KVD__CPU_BMI2);
}

/* The exact scores of the candidates cand[0..nc) of the step of 64 tokens
 * at p (token i); those above the threshold enter tb (which has room for
 * them). Four at a time, interleaved: each is a chain of dependent adds (for
 * m = 2, two adds, one at a time is faster). */
/* Re-score a step's candidates exactly (offsets cand[] from token i, rows at
 * p), pushing those above the threshold. Candidates are few a step (one or
 * two of 64 mostly), and a score is a chain of m dependent adds: they are
 * queued across steps and scored four at a time, four independent chains;
 * a quantized scan calls tb_flush when it ends. The scan leaves room in the
 * buffer for a step's candidates and the 3 that may wait. */
__attribute__((always_inline)) static inline void rescore(int M, const uint8_t *p,
                                                          const int32_t *cand, int nc,
                                                          const float *lut, int64_t i, topk_buf *tb)
{
    tb->rescored += (uint64_t)nc;
    if (M == 2) { /* two adds: chains too short to gain from interleaving */
        const float thr = tb->thr;
        for (int c = 0; c < nc; c++) {
            float sc = score_one(M, p + cand[c] * M, lut);
            if (!(sc <= thr))
                tb_push(tb, sc, (uint32_t)(i + cand[c]));
        }
        return;
    }
    for (int c = 0; c < nc; c++) {
        tb->prow[tb->np] = p + cand[c] * M;
        tb->ptok[tb->np++] = (uint32_t)(i + cand[c]);
        if (tb->np == 4) {
            float sc[4];
            score_four(M, tb->prow, lut, sc);
            for (int l = 0; l < 4; l++)
                if (!(sc[l] <= tb->thr))
                    tb_push(tb, sc[l], tb->ptok[l]);
            tb->np = 0;
        }
    }
}

/* Score the candidates rescore left waiting. */
static inline void tb_flush(int M, const float *lut, topk_buf *tb)
{
    for (int l = 0; l < tb->np; l++) {
        float sc = score_one(M, tb->prow[l], lut);
        if (!(sc <= tb->thr))
            tb_push(tb, sc, tb->ptok[l]);
    }
    tb->np = 0;
}

VBMI_TARGET __attribute__((always_inline)) static inline void
scan_vbmi_m(int M, int B6, const uint8_t *codes, const float *lut, const pq_qlut *ql, int64_t i0,
            int64_t i1, topk_buf *tb)
{
    const int E = 64 / M; /* tokens per register = bytes per transposed element */
    /* stage 1: byte q = j*E + t of the result takes byte t*M + j */
    uint8_t perm1[64];
    for (int q = 0; q < 64; q++)
        perm1[q] = (uint8_t)((q % E) * M + q / E);
    const __m512i p1 = _mm512_loadu_si512(perm1);
    /* stage 2 index vectors (dword units) per block size s */
    __m512i ia[4], ib[4];
    const int ed = E / 4; /* dwords per element */
    int ns = 0;
    for (int sblk = M / 2; sblk >= 1; sblk /= 2, ns++) {
        int32_t a[16], bb[16];
        for (int p = 0; p < 16; p++) {
            int k = p / ed, o = p % ed;
            a[p] = (k & sblk) ? 16 + (k - sblk) * ed + o : p;
            bb[p] = (k & sblk) ? 16 + p : (k + sblk) * ed + o;
        }
        ia[ns] = _mm512_loadu_si512(a);
        ib[ns] = _mm512_loadu_si512(bb);
    }
    __m512i tab[16][4];
    for (int j = 0; j < M; j++)
        for (int t = 0; t < (B6 ? 1 : 4); t++)
            tab[j][t] = _mm512_loadu_si512(ql->q[j] + 64 * t);
    const __m512i lo8 = _mm512_set1_epi16(0x00FF);
    int qthr = qlut_threshold(ql, tb->thr);
    __m512i vq = _mm512_set1_epi16((short)qthr);
    int64_t i = i0;
    for (; i + 64 <= i1; i += 64) {
        const uint8_t *p = codes + i * M;
        __m512i r[16];
#pragma GCC unroll 16
        for (int j = 0; j < M; j++)
            r[j] = _mm512_permutexvar_epi8(p1, _mm512_loadu_si512(p + 64 * j));
        int st = 0;
#pragma GCC unroll 4
        for (int sblk = M / 2; sblk >= 1; sblk /= 2, st++)
#pragma GCC unroll 16
            for (int a = 0; a < M; a++) {
                if (a & sblk)
                    continue;
                __m512i x = r[a], y = r[a + sblk];
                r[a] = _mm512_permutex2var_epi32(x, ia[st], y);
                r[a + sblk] = _mm512_permutex2var_epi32(x, ib[st], y);
            }
        __m512i ae = _mm512_setzero_si512(), ao = _mm512_setzero_si512();
#pragma GCC unroll 16
        for (int j = 0; j < M; j++) {
            __m512i v = r[j], q;
            if (B6) { /* b <= 6: 64 entries, one vpermb */
                q = _mm512_permutexvar_epi8(v, tab[j][0]);
            } else {
                __m512i l0 = _mm512_permutex2var_epi8(tab[j][0], v, tab[j][1]);
                __m512i l1 = _mm512_permutex2var_epi8(tab[j][2], v, tab[j][3]);
                q = _mm512_mask_blend_epi8(_mm512_movepi8_mask(v), l0, l1);
            }
            ae = _mm512_add_epi16(ae, _mm512_and_si512(q, lo8));
            ao = _mm512_add_epi16(ao, _mm512_srli_epi16(q, 8));
        }
        __mmask32 me = _mm512_cmpgt_epi16_mask(ae, vq), mo = _mm512_cmpgt_epi16_mask(ao, vq);
        if (__builtin_expect((me | mo) != 0, 0)) {
            if (tb->n + 64 + 3 > tb->cap) {
                tb_compact(tb);
                qthr = qlut_threshold(ql, tb->thr);
                vq = _mm512_set1_epi16((short)qthr);
            }
            uint64_t mask = _pdep_u64(me, 0x5555555555555555ull) |
                            _pdep_u64(mo, 0xAAAAAAAAAAAAAAAAull);
            int32_t cand[64];
            int nc = 0;
            while (mask) {
                cand[nc++] = __builtin_ctzll(mask);
                mask &= mask - 1;
            }
            rescore(M, p, cand, nc, lut, i, tb);
        }
    }
    tb->steps += (uint64_t)(i - i0) / 64;
    tb_flush(M, lut, tb);
    scan_avx2(M, codes, lut, i, i1, tb);
}

/*
 * The same filter for 4-bit codes (b = 4), without the transpose: the 16
 * entries of four sub-spaces fill one 64-byte table, so a register of code
 * rows is looked up in place, each byte's index being its code plus 16 x its
 * sub-space's place in the table (one vpermb for m = 2 and 4, one vpermi2b
 * over 8 sub-spaces for m = 8, two and a blend for m = 16). The sums of a
 * token's bytes are lanes of their own: pmaddubsw for m = 2 (u16), then
 * pmaddwd for m = 4 (u32), psadbw for m = 8 and 16 (u64, the two halves of a
 * 16-byte row added across a pair of registers). A step takes 64 tokens and
 * tests only the largest sum against the threshold; the rare step that
 * passes finds its candidates lane by lane. A code of 16 or more (an entry of
 * -inf, ranked last) is read as its low 4 bits: the bound is then one of a
 * real entry, above the token's -inf, and the exact re-score drops it.
 */
VBMI_TARGET __attribute__((always_inline)) static inline void
scan_vbmi4_m(int M, const uint8_t *codes, const float *lut, const pq_qlut *ql, int64_t i0,
             int64_t i1, topk_buf *tb)
{
    /* R registers of code rows a step, T tokens a register; a token's sum
     * is a u16 lane for M = 2, u32 for M = 4, u64 otherwise */
    enum { MAXR = 16 };
    const int R = M, T = 64 / M;
    uint8_t off[64];
    for (int q = 0; q < 64; q++)
        off[q] = (uint8_t)(16 * ((q % M) & 7));
    const __m512i voff = _mm512_loadu_si512(off), lo4 = _mm512_set1_epi8(0x0F);
    const __m512i t0 = _mm512_loadu_si512(ql->nib[0]), t1 = _mm512_loadu_si512(ql->nib[1]);
    const __m512i t2 = _mm512_loadu_si512(ql->nib[2]), t3 = _mm512_loadu_si512(ql->nib[3]);
    const __m512i one8 = _mm512_set1_epi8(1), one16 = _mm512_set1_epi16(1);
    const __m512i zero = _mm512_setzero_si512();
    /* the threshold in every sum lane */
#define Q4_THR(q)                                                                                  \
    (M == 2 ? _mm512_set1_epi16((short)(q)) : M == 4 ? _mm512_set1_epi32(q) : _mm512_set1_epi64(q))
    __m512i vq = Q4_THR(qlut_threshold(ql, tb->thr));
    int64_t i = i0;
    for (; i + 64 <= i1; i += 64) {
        const uint8_t *p = codes + i * M;
        __m512i sum[MAXR], big = _mm512_set1_epi64(-1);
#pragma GCC unroll 16
        for (int r = 0; r < R; r++) {
            /* (code & 15) | offset */
            __m512i ix = _mm512_ternarylogic_epi32(_mm512_loadu_si512(p + 64 * r), lo4, voff, 0xEA);
            __m512i v;
            if (M == 2) {
                v = _mm512_maddubs_epi16(_mm512_permutexvar_epi8(ix, t0), one8);
                big = _mm512_max_epi16(big, v);
            } else if (M == 4) {
                v = _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_permutexvar_epi8(ix, t0), one8),
                                      one16);
                big = _mm512_max_epi32(big, v);
            } else if (M == 8) {
                v = _mm512_sad_epu8(_mm512_permutex2var_epi8(t0, ix, t1), zero);
                big = _mm512_max_epi64(big, v);
            } else {
                __m512i a = _mm512_permutex2var_epi8(t0, ix, t1);
                __m512i c = _mm512_permutex2var_epi8(t2, ix, t3);
                v = _mm512_sad_epu8(_mm512_mask_blend_epi64(0xAA, a, c), zero);
            }
            sum[r] = v;
        }
        if (M == 16)
#pragma GCC unroll 8
            /* register pair (2h, 2h + 1) -> lane 2l: token 8h + l, lane 2l + 1:
             * token 8h + 4 + l (l < 4) */
            for (int h = 0; h < R / 2; h++) {
                __m512i a = sum[2 * h], c = sum[2 * h + 1];
                sum[h] = _mm512_add_epi64(_mm512_unpacklo_epi64(a, c), _mm512_unpackhi_epi64(a, c));
                big = _mm512_max_epi64(big, sum[h]);
            }
        int pass = M == 2   ? _mm512_cmpgt_epi16_mask(big, vq) != 0
                   : M == 4 ? _mm512_cmpgt_epi32_mask(big, vq) != 0
                            : _mm512_cmpgt_epi64_mask(big, vq) != 0;
        if (__builtin_expect(pass, 0)) {
            if (tb->n + 64 + 3 > tb->cap) {
                tb_compact(tb);
                vq = Q4_THR(qlut_threshold(ql, tb->thr));
            }
            const int nv = M == 16 ? R / 2 : R;
            int32_t cand[64];
            int nc = 0;
            for (int r = 0; r < nv; r++) {
                uint64_t mk = M == 2   ? _mm512_cmpgt_epi16_mask(sum[r], vq)
                              : M == 4 ? _mm512_cmpgt_epi32_mask(sum[r], vq)
                                       : _mm512_cmpgt_epi64_mask(sum[r], vq);
                while (mk) {
                    int l = __builtin_ctzll(mk);
                    mk &= mk - 1;
                    cand[nc++] = M == 16 ? 8 * r + (l & 1) * 4 + l / 2 : T * r + l;
                }
            }
            rescore(M, p, cand, nc, lut, i, tb);
        }
    }
#undef Q4_THR
    tb->steps += (uint64_t)(i - i0) / 64;
    tb_flush(M, lut, tb);
    scan_avx2(M, codes, lut, i, i1, tb);
}

/* m in {2, 4, 8, 16}: 4-bit codes in place, up to 6 bits on one vpermb, 8
 * bits on two vpermi2b. */
#define SCAN_VBMI(M)                                                                               \
    (ql->b == 4   ? scan_vbmi4_m(M, codes, lut, ql, i0, i1, tb)                                    \
     : ql->b <= 6 ? scan_vbmi_m(M, 1, codes, lut, ql, i0, i1, tb)                                  \
                  : scan_vbmi_m(M, 0, codes, lut, ql, i0, i1, tb))
VBMI_TARGET static void scan_vbmi(int m, const uint8_t *codes, const float *lut,
                                  const pq_qlut *ql, int64_t i0, int64_t i1, topk_buf *tb)
{
    switch (m) {
    case 2:
        SCAN_VBMI(2);
        break;
    case 4:
        SCAN_VBMI(4);
        break;
    case 8:
        SCAN_VBMI(8);
        break;
    default:
        SCAN_VBMI(16);
        break;
    }
}
#undef SCAN_VBMI

/*
 * The filter with AVX2 only (CPUs without VBMI), m = 2, 4, 8, 16, b = 4..8:
 * 16-byte groups of code rows (16 / m tokens a group), 32 groups a step
 * (lane 0 of register k: group k, lane 1: group 16 + k), are transposed in
 * registers, four rounds of byte interleaves (after which register k holds
 * byte k of every group, byte w of a lane group w), so that pshufb looks
 * each register's codes up in its sub-space's quantized table where they
 * lie. A 4-bit code takes one pshufb on the sub-space's 16 entries. A
 * b-bit code takes one pshufb on each 16-entry part of the table (entries
 * 16 h .. 16 h + 15, h = the code's bits 4 and up) and a tree of byte blends
 * on bits 4 .. b - 1 (bit 7's parts read the code without it, since pshufb
 * reads 0 for an index with bit 7 set): 2^(b-4) lookups and 2^(b-4) - 1
 * blends for 32 codes, where the float scan gathers 32 entries. A code of
 * 2^b or more (an entry of -inf, ranked last) reads 0 or a real entry:
 * either bounds that token's -inf. Sums in u16 lanes, even and odd groups
 * apart.
 */
__attribute__((target("avx2,fma"), always_inline)) static inline void t4_round(const __m256i in[16],
                                                                               __m256i out[16])
{
#pragma GCC unroll 8
    for (int i = 0; i < 8; i++) {
        out[2 * i] = _mm256_unpacklo_epi8(in[i], in[i + 8]);
        out[2 * i + 1] = _mm256_unpackhi_epi8(in[i], in[i + 8]);
    }
}

__attribute__((target("avx2,fma"), always_inline)) static inline void t4_transpose(__m256i r[16])
{
    __m256i t[16];
    t4_round(r, t);
    t4_round(t, r);
    t4_round(r, t);
    t4_round(t, r);
}

/* The quantized entries of the codes c (one sub-space) from its B-bit table,
 * tabs[h] = entries 16 h .. 16 h + 15 in both lanes. */
__attribute__((target("avx2,fma"), always_inline)) static inline __m256i
q_lookup(const int B, const __m256i *tabs, __m256i c)
{
    if (B == 4)
        return _mm256_shuffle_epi8(tabs[0], c);
    enum { MAXT = 16 };
    const int nt = 1 << (B - 4);
    const __m256i c7 = B == 8 ? _mm256_and_si256(c, _mm256_set1_epi8(0x7F)) : c;
    __m256i v[MAXT];
#pragma GCC unroll 16
    for (int h = 0; h < nt; h++) {
        v[h] = _mm256_shuffle_epi8(tabs[h], h >= 8 ? c7 : c);
    }
    /* level l joins parts that differ in bit 4 + l (blendv reads bit 7 of
     * each byte: the code shifted left by 3 - l within its 16-bit word) */
#pragma GCC unroll 4
    for (int l = 0, w = nt; l < B - 4; l++, w /= 2) {
        const __m256i sel = l == 3 ? c : _mm256_slli_epi16(c, 3 - l);
#pragma GCC unroll 8
        for (int h = 0; h < w / 2; h++)
            v[h] = _mm256_blendv_epi8(v[2 * h], v[2 * h + 1], sel);
    }
    return v[0];
}

__attribute__((target("avx2,fma"), always_inline)) static inline void
scan_avx2q_m(int M, const int B, const uint8_t *codes, const float *lut, const pq_qlut *ql,
             int64_t i0, int64_t i1, topk_buf *tb)
{
    const int g = 16 / M; /* tokens a group */
    const int S = 32 * g; /* tokens a step */
    const int nt = 1 << (B - 4);
    /* tabs[j][h]: sub-space j's entries 16 h .. 16 h + 15 in both lanes */
    __m256i tabs[16][16];
    for (int j = 0; j < M; j++)
        for (int h = 0; h < nt; h++)
            tabs[j][h] =
                _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(ql->q[j] + 16 * h)));
    const __m256i lo8 = _mm256_set1_epi16(0x00FF);
    int qthr = qlut_threshold(ql, tb->thr);
    __m256i vq = _mm256_set1_epi16((short)qthr);
    int64_t i = i0;
    for (; i + S <= i1; i += S) {
        const uint8_t *p = codes + i * M;
        __m256i r[16];
#pragma GCC unroll 16
        for (int k = 0; k < 16; k++)
            r[k] = _mm256_inserti128_si256(
                _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(p + 16 * k))),
                _mm_loadu_si128((const __m128i *)(p + 16 * (k + 16))), 1);
        t4_transpose(r);
        /* token u of a group: places [u M, u M + M) */
        __m256i ae[8], ao[8];
#pragma GCC unroll 8
        for (int u = 0; u < g; u++) {
            ae[u] = ao[u] = _mm256_setzero_si256();
#pragma GCC unroll 16
            for (int k = u * M; k < u * M + M; k++) {
                __m256i x = q_lookup(B, tabs[k % M], r[k]);
                ae[u] = _mm256_add_epi16(ae[u], _mm256_and_si256(x, lo8));
                ao[u] = _mm256_add_epi16(ao[u], _mm256_srli_epi16(x, 8));
            }
        }
        __m256i big = _mm256_max_epi16(ae[0], ao[0]);
#pragma GCC unroll 8
        for (int u = 1; u < g; u++)
            big = _mm256_max_epi16(big, _mm256_max_epi16(ae[u], ao[u]));
        if (__builtin_expect(_mm256_movemask_epi8(_mm256_cmpgt_epi16(big, vq)) != 0, 0)) {
            if (tb->n + S + 3 > tb->cap) {
                tb_compact(tb);
                qthr = qlut_threshold(ql, tb->thr);
                vq = _mm256_set1_epi16((short)qthr);
            }
            int32_t cand[256];
            int nc = 0;
            for (int u = 0; u < g; u++)
                for (int odd = 0; odd < 2; odd++) {
                    /* u16 lane l: byte 2 (l % 8) + odd of lane l / 8, a group */
                    uint32_t mk = (uint32_t)_mm256_movemask_epi8(
                                      _mm256_cmpgt_epi16(odd ? ao[u] : ae[u], vq)) &
                                  0x55555555u;
                    while (mk) {
                        int l = __builtin_ctz(mk) / 2;
                        mk &= mk - 1;
                        cand[nc++] = ((l / 8) * 16 + 2 * (l % 8) + odd) * g + u;
                    }
                }
            rescore(M, p, cand, nc, lut, i, tb);
        }
    }
    tb->steps += (uint64_t)(i - i0) / 64;
    tb_flush(M, lut, tb);
    scan_avx2(M, codes, lut, i, i1, tb);
}

#define SCAN_AVX2Q(B)                                                                              \
    do {                                                                                           \
        switch (m) {                                                                               \
        case 2:                                                                                    \
            scan_avx2q_m(2, B, codes, lut, ql, i0, i1, tb);                                        \
            break;                                                                                 \
        case 4:                                                                                    \
            scan_avx2q_m(4, B, codes, lut, ql, i0, i1, tb);                                        \
            break;                                                                                 \
        case 8:                                                                                    \
            scan_avx2q_m(8, B, codes, lut, ql, i0, i1, tb);                                        \
            break;                                                                                 \
        default:                                                                                   \
            scan_avx2q_m(16, B, codes, lut, ql, i0, i1, tb);                                       \
            break;                                                                                 \
        }                                                                                          \
    } while (0)
/* m in {2, 4, 8, 16}, b = ql->b in 4..8 (one copy per b; 6 and 8 are the
 * usual widths besides 4, and 5 and 7 go through the 6- and 8-bit trees,
 * whose extra parts hold zeros) */
__attribute__((target("avx2,fma"))) static void scan_avx2q(int m, const uint8_t *codes,
                                                           const float *lut, const pq_qlut *ql,
                                                           int64_t i0, int64_t i1, topk_buf *tb)
{
    if (ql->b == 4)
        SCAN_AVX2Q(4);
    else if (ql->b <= 6)
        SCAN_AVX2Q(6);
    else
        SCAN_AVX2Q(8);
}
#undef SCAN_AVX2Q

/* State of a packed scan: tables, threshold, candidates waiting. */
typedef struct pk_scan {
    __m512i tabs4[4];    /* pk_block512: sub-spaces 4 q .. 4 q + 3 */
    __m256i tabs[8], vq; /* vq: the threshold's Q in every u16 lane */
    int m, P, np;
    int64_t bsz, i0, i1;
    const uint8_t *packed;
    const float *lut;
    const pq_qlut *ql;
    int64_t pend[8]; /* candidates waiting to be scored eight at a time */
} pk_scan;

/* Cut tb back to its k best and take the threshold it leaves. */
__attribute__((target("avx2,fma"))) static void pk_cut(pk_scan *ps, topk_buf *tb)
{
    tb_compact(tb);
    ps->vq = _mm256_set1_epi16((short)qlut_threshold(ps->ql, tb->thr));
}

/* One pair of sub-spaces of a block (32 bytes v, tables tab) into the u16
 * sums: a, b of the low and high nibbles' bytes, ao, bo of their odd bytes
 * alone. */
__attribute__((target("avx2,fma"), always_inline)) static inline void
pk_pair(__m256i tab, __m256i v, __m256i *a, __m256i *ao, __m256i *b, __m256i *bo)
{
    const __m256i nib = _mm256_set1_epi8(0x0F);
    const __m256i x = _mm256_shuffle_epi8(tab, _mm256_and_si256(v, nib));
    const __m256i y = _mm256_shuffle_epi8(tab, _mm256_and_si256(_mm256_srli_epi16(v, 4), nib));
    *a = _mm256_add_epi16(*a, x);
    *ao = _mm256_add_epi16(*ao, _mm256_srli_epi16(x, 8));
    *b = _mm256_add_epi16(*b, y);
    *bo = _mm256_add_epi16(*bo, _mm256_srli_epi16(y, 8));
}

/* The masks of pk_block from its sums (the lanes: even and odd sub-spaces). */
__attribute__((target("avx2,fma"), always_inline)) static inline void
pk_masks(const pk_scan *ps, __m256i a, __m256i ao, __m256i b, __m256i bo, uint32_t *me,
         uint32_t *mo)
{
    const __m256i ae = _mm256_sub_epi16(a, _mm256_slli_epi16(ao, 8));
    const __m256i be = _mm256_sub_epi16(b, _mm256_slli_epi16(bo, 8));
    const __m256i ev = _mm256_add_epi16(_mm256_permute2x128_si256(ae, be, 0x20),
                                        _mm256_permute2x128_si256(ae, be, 0x31));
    const __m256i od = _mm256_add_epi16(_mm256_permute2x128_si256(ao, bo, 0x20),
                                        _mm256_permute2x128_si256(ao, bo, 0x31));
    *me = (uint32_t)_mm256_movemask_epi8(_mm256_cmpgt_epi16(ev, ps->vq));
    *mo = (uint32_t)_mm256_movemask_epi8(_mm256_cmpgt_epi16(od, ps->vq));
}

/* The threshold masks of the block at bp: bit 2 l of *me (*mo) set when
 * token 16 (l / 8) + 2 (l % 8) (+ 1) has a quantized sum above the
 * threshold's. */
__attribute__((target("avx2,fma"), always_inline)) static inline void
pk_block(const pk_scan *ps, const int P, const uint8_t *bp, uint32_t *me, uint32_t *mo)
{
    __m256i a = _mm256_setzero_si256(), ao = a, b = a, bo = a;
#pragma GCC unroll 8
    for (int p = 0; p < P; p++)
        pk_pair(ps->tabs[p], _mm256_loadu_si256((const __m256i *)(bp + 32 * p)), &a, &ao, &b, &bo);
    pk_masks(ps, a, ao, b, bo, me, mo);
}

#define PK512_TARGET __attribute__((target("avx512f,avx512bw,avx2,fma,bmi2")))

/* pk_block with AVX-512BW: four sub-spaces a 64-byte load (ps->tabs4[q]:
 * sub-space 4 q + s in lane s), the last pair of an odd P as in pk_block.
 * The four lanes' sums are folded to two (sums modulo 2^16, in any order)
 * before pk_masks: the same masks. */
PK512_TARGET __attribute__((always_inline)) static inline void
pk_block512(const pk_scan *ps, const int P, const uint8_t *bp, uint32_t *me, uint32_t *mo)
{
    const __m512i nib = _mm512_set1_epi8(0x0F);
    __m512i a = _mm512_setzero_si512(), ao = a, b = a, bo = a;
#pragma GCC unroll 4
    for (int q = 0; q < P / 2; q++) {
        const __m512i v = _mm512_loadu_si512((const void *)(bp + 64 * q));
        const __m512i x = _mm512_shuffle_epi8(ps->tabs4[q], _mm512_and_si512(v, nib));
        const __m512i y =
            _mm512_shuffle_epi8(ps->tabs4[q], _mm512_and_si512(_mm512_srli_epi16(v, 4), nib));
        a = _mm512_add_epi16(a, x);
        ao = _mm512_add_epi16(ao, _mm512_srli_epi16(x, 8));
        b = _mm512_add_epi16(b, y);
        bo = _mm512_add_epi16(bo, _mm512_srli_epi16(y, 8));
    }
#define PK_FOLD(z) _mm256_add_epi16(_mm512_castsi512_si256(z), _mm512_extracti64x4_epi64(z, 1))
    __m256i a2 = PK_FOLD(a), ao2 = PK_FOLD(ao), b2 = PK_FOLD(b), bo2 = PK_FOLD(bo);
#undef PK_FOLD
    if (P & 1)
        pk_pair(ps->tabs[P - 1], _mm256_loadu_si256((const __m256i *)(bp + 32 * (P - 1))), &a2,
                &ao2, &b2, &bo2);
    pk_masks(ps, a2, ao2, b2, bo2, me, mo);
}

/* The tokens of the block of tokens base.. (masks of pk_block) that lie in
 * [i0, i1), appended to cand; returns their number. */
static inline int pk_cands(const pk_scan *ps, int64_t base, uint32_t me, uint32_t mo, int64_t *cand)
{
    int nc = 0;
    for (int odd = 0; odd < 2; odd++) {
        uint32_t mk = (odd ? mo : me) & 0x55555555u;
        while (mk) {
            int l = __builtin_ctz(mk) / 2;
            mk &= mk - 1;
            int64_t t = base + (l / 8) * 16 + 2 * (l % 8) + odd;
            cand[nc] = t;
            nc += t >= ps->i0 && t < ps->i1;
        }
    }
    return nc;
}

/* Score the candidates cand[0..nc) exactly; those above the threshold
 * enter tb (which has room for nc + 8). */
__attribute__((target("avx2,fma"))) static void pk_take(pk_scan *ps, const int64_t *cand, int nc,
                                                        topk_buf *tb)
{
    const int m = ps->m;
    if (m <= 4) { /* chains of up to 4 adds: scored at once; the key is
                   * written always and kept by the count, without a branch
                   * that a candidate's score would mispredict */
        tb->rescored += (uint64_t)nc;
        const float thr = tb->thr;
        for (int c = 0; c < nc; c++) {
            float sc = score_packed1(m, ps->packed, cand[c], ps->lut);
            tb->keys[tb->n] = make_key(sc, (uint32_t)cand[c]);
            tb->n += !(sc <= thr);
        }
        return;
    }
    for (int c = 0; c < nc; c++) {
        ps->pend[ps->np++] = cand[c];
        if (ps->np == 8) {
            float sc[8];
            tb->rescored += 8;
            score_packed8(m, ps->packed, ps->pend, ps->lut, sc);
            for (int l = 0; l < 8; l++)
                if (!(sc[l] <= tb->thr))
                    tb_push(tb, sc[l], (uint32_t)ps->pend[l]);
            ps->np = 0;
        }
    }
}

/* Blocks [bi, be) of a packed scan, U blocks a step (be - bi a multiple of
 * U): one branch for a step whose blocks have no candidate. BLOCK is
 * pk_block or pk_block512, TARGET its target. */
#define PK_BLOCKS(NAME, BLOCK, TARGET)                                                             \
    TARGET __attribute__((always_inline)) static inline void NAME(                                 \
        pk_scan *ps, const int P, const int U, int64_t bi, int64_t be, topk_buf *tb)               \
    {                                                                                              \
        for (; bi < be; bi += U) {                                                                 \
            uint32_t me[8], mo[8], any = 0;                                                        \
            _Pragma("GCC unroll 8") for (int u = 0; u < U; u++)                                    \
            {                                                                                      \
                BLOCK(ps, P, ps->packed + (bi + u) * ps->bsz, &me[u], &mo[u]);                     \
                any |= me[u] | mo[u];                                                              \
            }                                                                                      \
            if (__builtin_expect(any == 0, 1))                                                     \
                continue;                                                                          \
            if (tb->n + 32 * U + 8 > tb->cap)                                                      \
                pk_cut(ps, tb);                                                                    \
            int64_t cand[256];                                                                     \
            int nc = 0;                                                                            \
            for (int u = 0; u < U; u++)                                                            \
                nc += pk_cands(ps, (bi + u) * 32, me[u], mo[u], cand + nc);                        \
            pk_take(ps, cand, nc, tb);                                                             \
        }                                                                                          \
    }
PK_BLOCKS(pk_blocks, pk_block, __attribute__((target("avx2,fma"))))
PK_BLOCKS(pk_blocks512, pk_block512, PK512_TARGET)
#undef PK_BLOCKS

/*
 * m <= 2: a token's score is one of 256 sums lut[0][a] + lut[1][b], so the
 * threshold test itself is a table: pass[a] bit b = !(score(a, b) <= thr),
 * with score_one's floats (m = 1: lut[0][a] alone). Rows a of the table are
 * two 16-entry byte tables (b < 8, b >= 8) looked up by code a; a third
 * gives the bit of code b. Exact: only tokens that beat the threshold are
 * candidates, where the 8-bit bound also let through every token tied with
 * it or near it (a few per cent of all at m = 2). Rebuilt at each cut of the
 * buffer, when the threshold rises.
 */
typedef struct pk_pass2 {
    __m256i lo, hi, bit;
} pk_pass2;

__attribute__((target("avx2,fma"))) static void pk_pass2_build(int m, const float *lut, float thr,
                                                               pk_pass2 *pt)
{
    uint8_t lo[16], hi[16], bit[16];
    for (int a = 0; a < 16; a++) {
        unsigned row = 0;
        for (int b = 0; b < 16; b++) {
            float sc = lut[a];
            if (m == 2)
                sc = sc + lut[256 + b];
            row |= (unsigned)!(sc <= thr) << b;
        }
        lo[a] = (uint8_t)row;
        hi[a] = (uint8_t)(row >> 8);
        bit[a] = (uint8_t)(1u << (a & 7));
    }
    pt->lo = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)lo));
    pt->hi = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)hi));
    pt->bit = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)bit));
}

/* Bit i set when token i of the block at bp passes (pk_pass2). */
__attribute__((target("avx2,fma"), always_inline)) static inline uint32_t
pk_pass2_block(const pk_pass2 *pt, const uint8_t *bp)
{
    const __m256i nib = _mm256_set1_epi8(0x0F);
    const __m256i v = _mm256_loadu_si256((const __m256i *)bp);
    const __m256i lo = _mm256_and_si256(v, nib);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
    /* a: sub-space 0's codes of tokens 0-15 | 16-31; b: sub-space 1's */
    const __m256i a = _mm256_permute2x128_si256(lo, hi, 0x20);
    const __m256i b = _mm256_permute2x128_si256(lo, hi, 0x31);
    const __m256i row =
        _mm256_blendv_epi8(_mm256_shuffle_epi8(pt->lo, a), _mm256_shuffle_epi8(pt->hi, a),
                           _mm256_slli_epi16(b, 4)); /* bit 3 -> bit 7 */
    const __m256i hit = _mm256_and_si256(row, _mm256_shuffle_epi8(pt->bit, b));
    return ~(uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi8(hit, _mm256_setzero_si256()));
}

/* Blocks [b0, b1) of packed codes with m <= 2 through pk_pass2, eight
 * blocks a step. */
__attribute__((target("avx2,fma"))) static void scan_packed4_m2(int m, const uint8_t *packed,
                                                                const float *lut, int64_t i0,
                                                                int64_t i1, topk_buf *tb)
{
    pk_pass2 pt;
    pk_pass2_build(m, lut, tb->thr, &pt);
    const int64_t b0 = i0 / 32, b1 = (i1 + 31) / 32;
    for (int64_t bi = b0; bi < b1; bi += 8) {
        const int nb = b1 - bi < 8 ? (int)(b1 - bi) : 8;
        uint32_t mk[8], any = 0;
        for (int u = 0; u < nb; u++) {
            mk[u] = pk_pass2_block(&pt, packed + (bi + u) * 32);
            any |= mk[u];
        }
        if (__builtin_expect(any == 0, 1))
            continue;
        if (tb->n + 256 > tb->cap) {
            const float thr = tb->thr;
            tb_compact(tb);
            if (!(tb->thr == thr)) {
                /* the threshold rose: tokens of this step it now drops
                 * are dropped below by the exact test */
                pk_pass2_build(m, lut, tb->thr, &pt);
            }
        }
        const float thr = tb->thr;
        for (int u = 0; u < nb; u++) {
            uint32_t w = mk[u];
            while (w) {
                const int64_t t = (bi + u) * 32 + __builtin_ctz(w);
                w &= w - 1;
                if (t < i0 || t >= i1)
                    continue;
                tb->rescored++;
                const float sc = score_packed1(m, packed, t, lut);
                tb->keys[tb->n] = make_key(sc, (uint32_t)t);
                tb->n += !(sc <= thr);
            }
        }
    }
    tb->steps += (uint64_t)((i1 - i0 + 63) / 64);
}

/* Rows (n, 2) of 4-bit codes through pk_pass2: 16 tokens a 32-byte load
 * (a token's two codes are the bytes of one u16 word), eight loads a step.
 * A code of 16 or more (not validated per search) is looked up by its low
 * bits; its token scores -inf (or NaN), which never beats a threshold that
 * is a number, and with none yet (NaN) every token passes. */
__attribute__((target("avx2,fma"))) static void scan_rows_m2(const uint8_t *codes, const float *lut,
                                                             int64_t i0, int64_t i1, topk_buf *tb)
{
    pk_pass2 pt;
    pk_pass2_build(2, lut, tb->thr, &pt);
    const __m256i lo4 = _mm256_set1_epi16(0x000F), lob = _mm256_set1_epi16(0x00FF);
    int64_t i = i0;
    for (; i < i1; i += 128) {
        const int nl = i1 - i >= 128 ? 8 : (int)((i1 - i) / 16);
        uint32_t mk[8], any = 0;
        for (int u = 0; u < nl; u++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(codes + 2 * (i + 16 * u)));
            const __m256i a = _mm256_and_si256(v, lo4);
            const __m256i b = _mm256_and_si256(_mm256_srli_epi16(v, 8), lo4);
            const __m256i row =
                _mm256_blendv_epi8(_mm256_shuffle_epi8(pt.lo, a), _mm256_shuffle_epi8(pt.hi, a),
                                   _mm256_slli_epi16(b, 4));
            const __m256i hit =
                _mm256_and_si256(_mm256_and_si256(row, lob), _mm256_shuffle_epi8(pt.bit, b));
            mk[u] =
                ~(uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi16(hit, _mm256_setzero_si256())) &
                0x55555555u;
            any |= mk[u];
        }
        if (nl < 8 && i + 16 * nl < i1) { /* the last tokens, short of a load */
            mk[nl] = 0;
            for (int l = 0; i + 16 * nl + l < i1; l++)
                mk[nl] |= 1u << (2 * l);
            any |= mk[nl];
        }
        if (__builtin_expect(any == 0, 1))
            continue;
        if (tb->n + 128 > tb->cap) {
            const float thr = tb->thr;
            tb_compact(tb);
            if (!(tb->thr == thr))
                pk_pass2_build(2, lut, tb->thr, &pt);
        }
        const float thr = tb->thr;
        const int nu = nl < 8 && i + 16 * nl < i1 ? nl + 1 : nl;
        for (int u = 0; u < nu; u++) {
            uint32_t w = mk[u];
            while (w) {
                const int64_t t = i + 16 * u + __builtin_ctz(w) / 2;
                w &= w - 1;
                tb->rescored++;
                const float sc = score_one(2, codes + 2 * t, lut);
                tb->keys[tb->n] = make_key(sc, (uint32_t)t);
                tb->n += !(sc <= thr);
            }
        }
    }
    tb->steps += (uint64_t)((i1 - i0 + 63) / 64);
}

/*
 * Scan of packed 4-bit codes (kvd_pq_pack4), m <= 16, tokens [i0, i1), on
 * the quantized tables: a block of 32 tokens is m / 2 loads of 32 bytes,
 * whose low and high nibbles (tokens 0-15 and 16-31) index, with one pshufb
 * each, sub-space 2p's table in the low lane and 2p + 1's in the high one.
 * The byte results are summed as u16 words (a word holds an even token's
 * byte and the next odd token's) and, separately, shifted down (the odd
 * bytes alone); the even sums are the difference, exact modulo 2^16 since
 * no sum passes 16 x 255. Tokens whose sum passes the threshold's Q are
 * scored exactly, as in scan_avx2q; tokens of an edge block outside
 * [i0, i1) are skipped. With no threshold yet (NaN) every token is a
 * candidate until the buffer's first cut sets one. m of 3 to 8 take
 * several blocks a step (128 tokens for m <= 4), so that a step without
 * candidates costs one branch. scan_packed4_512 (CPUs with AVX-512BW) is the
 * same scan on pk_block512: four sub-spaces a load.
 */
#define SCAN_PACKED4(NAME, BLOCKS, BLOCK, TARGET, TABS4)                                           \
    TARGET static void NAME(int m, const uint8_t *packed, const float *lut, const pq_qlut *ql,     \
                            int64_t i0, int64_t i1, topk_buf *tb)                                  \
    {                                                                                              \
        pk_scan ps = {                                                                             \
            .m = m, .P = (m + 1) / 2, .packed = packed, .lut = lut, .ql = ql, .i0 = i0, .i1 = i1}; \
        ps.bsz = 32 * (int64_t)ps.P;                                                               \
        for (int p = 0; p < ps.P; p++) {                                                           \
            __m128i lo = _mm_loadu_si128((const __m128i *)ql->q[2 * p]);                           \
            __m128i hi = 2 * p + 1 < m ? _mm_loadu_si128((const __m128i *)ql->q[2 * p + 1])        \
                                       : _mm_setzero_si128();                                      \
            ps.tabs[p] = _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);               \
        }                                                                                          \
        TABS4(ps);                                                                                 \
        ps.vq = _mm256_set1_epi16((short)qlut_threshold(ql, tb->thr));                             \
        const int64_t b0 = i0 / 32, b1 = (i1 + 31) / 32;                                           \
        const int U = ps.P >= 2 && ps.P <= 4 ? 8 / ps.P : 1;                                       \
        const int64_t bm = b0 + (b1 - b0) / U * U;                                                 \
        switch (ps.P) { /* m <= 2 (P = 1) takes scan_packed4_m2, not this */                       \
        case 2:                                                                                    \
            BLOCKS(&ps, 2, 4, b0, bm, tb);                                                         \
            break;                                                                                 \
        case 3:                                                                                    \
            BLOCKS(&ps, 3, 2, b0, bm, tb);                                                         \
            break;                                                                                 \
        case 4:                                                                                    \
            BLOCKS(&ps, 4, 2, b0, bm, tb);                                                         \
            break;                                                                                 \
        case 5:                                                                                    \
            BLOCKS(&ps, 5, 1, b0, bm, tb);                                                         \
            break;                                                                                 \
        case 6:                                                                                    \
            BLOCKS(&ps, 6, 1, b0, bm, tb);                                                         \
            break;                                                                                 \
        case 7:                                                                                    \
            BLOCKS(&ps, 7, 1, b0, bm, tb);                                                         \
            break;                                                                                 \
        case 8:                                                                                    \
            BLOCKS(&ps, 8, 1, b0, bm, tb);                                                         \
            break;                                                                                 \
        default:                                                                                   \
            BLOCKS(&ps, ps.P, 1, b0, bm, tb);                                                      \
            break;                                                                                 \
        }                                                                                          \
        for (int64_t bi = bm; bi < b1; bi++) { /* the blocks short of a step */                    \
            uint32_t me, mo;                                                                       \
            BLOCK(&ps, ps.P, packed + bi * ps.bsz, &me, &mo);                                      \
            if (me | mo) {                                                                         \
                if (tb->n + 40 > tb->cap)                                                          \
                    pk_cut(&ps, tb);                                                               \
                int64_t cand[32];                                                                  \
                pk_take(&ps, cand, pk_cands(&ps, bi * 32, me, mo, cand), tb);                      \
            }                                                                                      \
        }                                                                                          \
        for (int c = 0; c < ps.np; c++) {                                                          \
            float sc = score_packed1(m, packed, ps.pend[c], lut);                                  \
            if (!(sc <= tb->thr))                                                                  \
                tb_push(tb, sc, (uint32_t)ps.pend[c]);                                             \
        }                                                                                          \
        tb->rescored += (uint64_t)ps.np;                                                           \
        tb->steps += (uint64_t)((i1 - i0 + 63) / 64);                                              \
    }
/* pk_block512's tables: sub-spaces 4 q .. 4 q + 3 (pairs 2 q, 2 q + 1); an
 * odd P's last pair stays in tabs */
#define PK_TABS4(ps)                                                                               \
    for (int q = 0; q < (ps).P / 2; q++)                                                           \
    (ps).tabs4[q] =                                                                                \
        _mm512_inserti64x4(_mm512_castsi256_si512((ps).tabs[2 * q]), (ps).tabs[2 * q + 1], 1)
#define PK_NO_TABS4(ps) (void)0
SCAN_PACKED4(scan_packed4, pk_blocks, pk_block, __attribute__((target("avx2,fma"))), PK_NO_TABS4)
SCAN_PACKED4(scan_packed4_512, pk_blocks512, pk_block512, PK512_TARGET, PK_TABS4)
#undef PK_TABS4
#undef PK_NO_TABS4
#undef SCAN_PACKED4

static int simd_ok(int m) { return m == 1 || m == 2 || (m % 4 == 0 && m <= 1024); }

/* One part of the scan of kvd__pq_search_cpu (kvd__par_for): part t scans
 * tokens [lo + t * per, lo + (t + 1) * per) into its own top-k buffer. */
typedef struct scan_job {
    int m, G;
    kvd_pq_agg agg;
    const uint8_t *codes, *packed; /* one of the two */
    const float *luts;
    const pq_qlut *ql;
    int ql_vbmi; /* ql is scanned by scan_vbmi (else scan_avx2q) */
    int pk512;   /* packed codes are scanned by scan_packed4_512 */
    int use_simd;
    int rows_m2; /* rows of m = 2, b = 4: scan_rows_m2 */
    int64_t lo, hi, per;
    uint64_t *bufs;
    int64_t cap, k;
    float thr0;
    int64_t *counts;
} scan_job;

static void scan_part(void *arg, int t)
{
    const scan_job *j = arg;
    int64_t a = j->lo + (int64_t)t * j->per, e = a + j->per < j->hi ? a + j->per : j->hi;
    topk_buf tb = {.keys = j->bufs + (int64_t)t * j->cap, .cap = j->cap, .k = j->k, .thr = j->thr0};
    if (a < e) {
        if (j->packed && j->m <= 2)
            scan_packed4_m2(j->m, j->packed, j->luts, a, e, &tb);
        else if (j->packed && j->pk512)
            scan_packed4_512(j->m, j->packed, j->luts, j->ql, a, e, &tb);
        else if (j->packed)
            scan_packed4(j->m, j->packed, j->luts, j->ql, a, e, &tb);
        else if (j->rows_m2)
            scan_rows_m2(j->codes, j->luts, a, e, &tb);
        else if (j->ql && !isnan(tb.thr) && j->ql_vbmi)
            scan_vbmi(j->m, j->codes, j->luts, j->ql, a, e, &tb);
        else if (j->ql && !isnan(tb.thr))
            scan_avx2q(j->m, j->codes, j->luts, j->ql, a, e, &tb);
        else if (j->use_simd)
            scan_avx2(j->m, j->codes, j->luts, a, e, &tb);
        else
            scan_scalar(j->m, j->G, j->agg, j->codes, j->luts, a, e, &tb);
    }
    tb_compact(&tb);
    j->counts[t] = tb.n;
    if (tb.steps) {
        __atomic_fetch_add(&pq_counters[0], tb.steps, __ATOMIC_RELAXED);
        __atomic_fetch_add(&pq_counters[1], tb.rescored, __ATOMIC_RELAXED);
    }
}

/* search_cpu's answer for packed codes whose tables cannot be quantized */
#define NO_QLUT 1

/* kvd__pq_search_cpu on codes given as rows or (src->packed: m <= 16, b = 4,
 * AGG_SUM, simd on a CPU with AVX2) packed. */
static int search_cpu(int nthreads, int simd, int64_t n, int m, int b, int D,
                      const float *centroids, const code_src *src, int G, const float *queries,
                      const kvd_pq_search_params *p, uint32_t *idx, float *scores, int64_t *nout)
{
    const uint8_t *codes = src->rows;
    *nout = 0;
    int allow_vbmi = simd == 1; /* 2 = AVX2 only (tests, benchmarks) */
    simd = simd && kvd_cpu_has_avx2_fma();
    float *luts = NULL;
    int rc = build_luts(simd, m, b, D, centroids, G, queries, p->agg, &luts);
    if (rc)
        return rc;
    int64_t s = p->sink < n ? (p->sink > 0 ? p->sink : 0) : n;
    int64_t w = p->window < n - s ? (p->window > 0 ? p->window : 0) : n - s;
    int64_t lo = s, hi = n - w, nm = hi - lo;
    int64_t k = p->k > 0 ? (p->k < nm ? p->k : nm) : 0;

    /* Threads only pay off on long ranges: each needs 16K tokens and
     * kvd__pq_thread_bytes of codes (the quantized scans take 2 MB of codes
     * in 70 us: two threads on 1 MB each were slower than one). */
    int nt = nthreads < 1 ? 1 : nthreads;
    if (k == 0)
        nt = 1;
    const int64_t min_bytes = __atomic_load_n(&kvd__pq_thread_bytes, __ATOMIC_RELAXED);
    while (nt > 1 && (nm / nt < 16384 || nm / nt * m < min_bytes))
        nt--;
    /* buffer: k winners + room for many candidates between cuts; when every
     * middle token fits, no cut ever happens */
    int64_t cap = k + (k > 256 ? k : 256) + 8;
    int64_t per = (nm + nt - 1) / nt;
    if (cap > per + 8)
        cap = per + 8;
    uint64_t *bufs = malloc(sizeof(uint64_t) * (size_t)cap * (size_t)nt);
    int64_t *counts = calloc((size_t)nt, sizeof(int64_t));
    if (!bufs || !counts) {
        free(bufs);
        free(counts);
        free(luts);
        return KVD_ENOMEM;
    }
    int use_simd = simd && p->agg != KVD_PQ_AGG_MAX && simd_ok(m);
    float thr0 = k > 0 ? guess_threshold(m, G, p->agg, src, luts, lo, nm, k) : NAN;
    /* quantized tables: the VBMI scans, else AVX2's (m = 2, 4, 8, 16) */
    pq_qlut *ql = NULL;
    const int ql_vbmi = allow_vbmi && (m == 2 || m == 4 || m == 8 || m == 16) && has_vbmi();
    const int rows_m2 = !src->packed && use_simd && m == 2 && b == 4;
    /* m <= 2, b = 4 (rows or packed) is tested with the exact table of
     * pk_pass2 and needs no quantized tables */
    if (src->packed && m > 2) {
        /* the packed scan needs its tables: without them (non-finite
         * entries) the caller unpacks the codes and searches the rows */
        ql = malloc(sizeof *ql);
        if (!ql || !build_qlut(m, 4, luts, ql)) {
            rc = ql ? NO_QLUT : KVD_ENOMEM;
            free(ql);
            free(bufs);
            free(counts);
            free(luts);
            return rc;
        }
    } else if (!src->packed && !rows_m2 && use_simd && !isnan(thr0) && b >= 4 && b <= 8 &&
               (m == 2 || m == 4 || m == 8 || m == 16)) {
        ql = malloc(sizeof *ql);
        if (ql && !build_qlut(m, b, luts, ql)) {
            free(ql);
            ql = NULL;
        }
    }
    for (int attempt = 0; k > 0 && attempt < 2; attempt++) {
        scan_job job = {.m = m,
                        .G = G,
                        .agg = p->agg,
                        .codes = codes,
                        .packed = src->packed,
                        .luts = luts,
                        .ql = ql,
                        .ql_vbmi = ql_vbmi,
                        .pk512 = allow_vbmi && has_avx512bw(),
                        .use_simd = use_simd,
                        .rows_m2 = rows_m2,
                        .lo = lo,
                        .hi = hi,
                        .per = per,
                        .bufs = bufs,
                        .cap = cap,
                        .k = k,
                        .thr0 = thr0,
                        .counts = counts};
        kvd__par_for(nt, nt, scan_part, &job);
        int64_t total = 0;
        for (int t = 0; t < nt; t++)
            total += counts[t];
        /* Exact when at least k tokens beat the starting threshold: every
         * token left out scored <= thr0 < the k-th best kept. Otherwise the
         * guess was too high: scan again admitting everything. */
        if (total >= k || isnan(thr0))
            break;
        thr0 = NAN;
        __atomic_fetch_add(&pq_counters[2], 1, __ATOMIC_RELAXED);
    }
    /* gather the per-thread winners at the front, cut to k */
    int64_t c = 0;
    for (int t = 0; t < nt; t++) {
        if (c != (int64_t)t * cap)
            memmove(bufs + c, bufs + (int64_t)t * cap, sizeof(uint64_t) * (size_t)counts[t]);
        c += counts[t];
    }
    if (c > k && k > 0)
        select_topk(bufs, c, k);
    if (c > k)
        c = k;
    rc = finish(n, m, G, p->agg, src, luts, p, bufs, c, idx, scores, nout);
    free(ql);
    free(bufs);
    free(counts);
    free(luts);
    return rc;
}

int kvd__pq_search_cpu(int nthreads, int simd, int64_t n, int m, int b, int D,
                       const float *centroids, const uint8_t *codes, int G, const float *queries,
                       const kvd_pq_search_params *p, uint32_t *idx, float *scores, int64_t *nout)
{
    const code_src src = {codes, NULL, m};
    return search_cpu(nthreads, simd, n, m, b, D, centroids, &src, G, queries, p, idx, scores,
                      nout);
}

int kvd__pq_search_packed4_cpu(int nthreads, int simd, int64_t n, int m, int D,
                               const float *centroids, const uint8_t *packed, int G,
                               const float *queries, const kvd_pq_search_params *p, uint32_t *idx,
                               float *scores, int64_t *nout)
{
    *nout = 0;
    if (simd && kvd_cpu_has_avx2_fma() && m <= 16 && p->agg == KVD_PQ_AGG_SUM) {
        const code_src src = {NULL, packed, m};
        int rc = search_cpu(nthreads, simd, n, m, 4, D, centroids, &src, G, queries, p, idx, scores,
                            nout);
        if (rc != NO_QLUT)
            return rc;
    }
    /* the rows path: every other case gives the same result from rows */
    uint8_t *rows = malloc((size_t)(n > 0 ? n : 1) * (size_t)m);
    if (!rows)
        return KVD_ENOMEM;
    for (int64_t i = 0; i < n; i++)
        unpack4_row(packed, m, i, rows + i * m);
    int rc = kvd__pq_search_cpu(nthreads, simd, n, m, 4, D, centroids, rows, G, queries, p, idx,
                                scores, nout);
    free(rows);
    return rc;
}

/* ---- train and encode -------------------------------------------------- */

void kvd_pq_encode_ref(int64_t n, int m, int b, int D, const float *keys, const float *centroids,
                       uint8_t *codes)
{
    const int ksub = 1 << b, dsub = D / m;
    for (int64_t i = 0; i < n; i++)
        for (int j = 0; j < m; j++) {
            uint32_t a;
            kvd_kmeans_assign_ref(1, dsub, keys + i * D + (int64_t)j * dsub, D, ksub,
                                  centroids + (int64_t)j * ksub * dsub, &a, NULL);
            codes[i * m + j] = (uint8_t)a;
        }
}

void kvd__pq_encode_cpu(int nthreads, int simd, int64_t n, int m, int b, int D,
                        const float *keys, const float *centroids, uint8_t *codes)
{
    const int ksub = 1 << b, dsub = D / m;
    const int64_t chunk = 4096; /* bounded scratch, any n */
    uint32_t *a = malloc(sizeof(uint32_t) * chunk);
    if (!a) {
        kvd_pq_encode_ref(n, m, b, D, keys, centroids, codes);
        return;
    }
    for (int64_t i0 = 0; i0 < n; i0 += chunk) {
        int64_t nb = n - i0 < chunk ? n - i0 : chunk;
        for (int j = 0; j < m; j++) {
            kvd__kmeans_assign_cpu(nthreads, simd, nb, dsub, keys + i0 * D + (int64_t)j * dsub, D,
                                   ksub, centroids + (int64_t)j * ksub * dsub, a, NULL);
            for (int64_t i = 0; i < nb; i++)
                codes[(i0 + i) * m + j] = (uint8_t)a[i];
        }
    }
    free(a);
}

int kvd__pq_train_cpu(int nthreads, int simd, const kvd_kmeans_params *km, int64_t n, int m,
                      int b, int D, const float *keys, float *centroids)
{
    const int ksub = 1 << b, dsub = D / m;
    for (int j = 0; j < m; j++) {
        kvd_kmeans_params p = *km;
        p.k = ksub;
        p.seed = km->seed + (uint64_t)j;
        int rc = simd || nthreads > 1
                     ? kvd__kmeans_train_cpu(nthreads, simd, &p, n, dsub, keys + (int64_t)j * dsub,
                                             D, centroids + (int64_t)j * ksub * dsub, NULL)
                     : kvd_kmeans_train_ref(&p, n, dsub, keys + (int64_t)j * dsub, D,
                                            centroids + (int64_t)j * ksub * dsub, NULL);
        if (rc)
            return rc;
    }
    return KVD_OK;
}

/* ---- tensors, wrappers, backend table ---------------------------------- */

typedef struct pq_shape {
    int m, b, D;
} pq_shape;

static int check_centroids(const kvd_tensor *c, pq_shape *sh, kvd_error *err)
{
    if (!c || c->dtype != KVD_DTYPE_F32 || c->ndim != 3 || !kvd_tensor_is_contiguous(c) ||
        !c->data || c->shape[0] < 1 || c->shape[0] > 4096 || c->shape[2] < 1 ||
        c->shape[2] > 4096)
        return kvd_error_set(err, KVD_EINVAL,
                             "pq: centroids must be a contiguous (m, 2^b, D/m) f32 tensor");
    int64_t ks = c->shape[1];
    if (ks != 16 && ks != 64 && ks != 256)
        return kvd_error_set(err, KVD_EINVAL, "pq: 2^b must be 16, 64 or 256 (b = 4, 6, 8), got %lld",
                             (long long)ks);
    sh->m = (int)c->shape[0];
    sh->b = ks == 16 ? 4 : ks == 64 ? 6 : 8;
    sh->D = (int)(c->shape[0] * c->shape[2]);
    return KVD_OK;
}

static int check_mat(const kvd_tensor *t, kvd_dtype dt, int64_t cols, const char *what,
                     kvd_error *err)
{
    if (!t || t->dtype != dt || t->ndim != 2 || t->shape[0] < 0 || t->shape[1] != cols ||
        !kvd_tensor_is_contiguous(t) || (t->shape[0] > 0 && !t->data))
        return kvd_error_set(err, KVD_EINVAL, "pq: %s must be a contiguous (rows, %lld) %s tensor",
                             what, (long long)cols, kvd_dtype_name(dt));
    return KVD_OK;
}

static int cpu_train(kvd_backend *be, const kvd_tensor *keys, const kvd_kmeans_params *km,
                     kvd_tensor *centroids, kvd_error *err)
{
    pq_shape sh = {0};
    check_centroids(centroids, &sh, NULL);
    int rc = kvd__pq_train_cpu(kvd__cpu_threads(be), kvd__cpu_fast(be), km, keys->shape[0], sh.m,
                               sh.b, sh.D, (const float *)keys->data, (float *)centroids->data);
    return rc ? kvd_error_set(err, rc, "pq: train: %s", kvd_strerror(rc)) : KVD_OK;
}

static int cpu_encode(kvd_backend *be, const kvd_tensor *keys, const kvd_tensor *centroids,
                      kvd_tensor *codes, kvd_error *err)
{
    (void)err;
    pq_shape sh = {0};
    check_centroids(centroids, &sh, NULL);
    int64_t n = keys->shape[0];
    if (!kvd__cpu_fast(be))
        kvd_pq_encode_ref(n, sh.m, sh.b, sh.D, (const float *)keys->data,
                          (const float *)centroids->data, (uint8_t *)codes->data);
    else
        kvd__pq_encode_cpu(kvd__cpu_threads(be), 1, n, sh.m, sh.b, sh.D,
                           (const float *)keys->data, (const float *)centroids->data,
                           (uint8_t *)codes->data);
    return KVD_OK;
}

static int cpu_search(kvd_backend *be, const kvd_tensor *centroids, const kvd_tensor *codes,
                      const kvd_tensor *queries, const kvd_pq_search_params *p,
                      kvd_tensor *indices, kvd_tensor *scores, int64_t *nout, kvd_error *err)
{
    pq_shape sh = {0};
    check_centroids(centroids, &sh, NULL);
    int rc;
    if (kvd__cpu_fast(be))
        rc = kvd__pq_search_cpu(kvd__cpu_threads(be), kvd__cpu_fast(be), codes->shape[0], sh.m,
                                sh.b, sh.D, (const float *)centroids->data,
                                (const uint8_t *)codes->data, (int)queries->shape[0],
                                (const float *)queries->data, p, (uint32_t *)indices->data,
                                scores ? (float *)scores->data : NULL, nout);
    else
        rc = kvd_pq_search_ref(codes->shape[0], sh.m, sh.b, sh.D, (const float *)centroids->data,
                               (const uint8_t *)codes->data, (int)queries->shape[0],
                               (const float *)queries->data, p, (uint32_t *)indices->data,
                               scores ? (float *)scores->data : NULL, nout);
    return rc ? kvd_error_set(err, rc, "pq: search: %s", kvd_strerror(rc)) : KVD_OK;
}

/* Jobs [lo, hi) of cpu_search_batch, one thread each (kvd__par_for). */
typedef struct batch_job {
    kvd_backend *be;
    kvd_pq_search_job *jobs;
    const kvd_pq_search_params *p;
    int *rcs;
    unsigned char *fill_failed; /* rcs[i] from job i's fill */
} batch_job;

static void batch_part(void *arg, int i)
{
    const batch_job *b = arg;
    kvd_pq_search_job *j = &b->jobs[i];
    if (j->fill && (b->rcs[i] = j->fill(j->fill_arg)) != 0) {
        b->fill_failed[i] = 1;
        return;
    }
    pq_shape sh = {0};
    check_centroids(j->centroids, &sh, NULL);
    const kvd_tensor *c = j->centroids, *codes = j->codes, *q = j->queries;
    int fast = kvd__cpu_fast(b->be);
    float *sc = j->scores ? (float *)j->scores->data : NULL;
    b->rcs[i] = fast ? kvd__pq_search_cpu(1, fast, codes->shape[0], sh.m, sh.b, sh.D,
                                          (const float *)c->data, (const uint8_t *)codes->data,
                                          (int)q->shape[0], (const float *)q->data, b->p,
                                          (uint32_t *)j->indices->data, sc, &j->nout)
                     : kvd_pq_search_ref(codes->shape[0], sh.m, sh.b, sh.D, (const float *)c->data,
                                         (const uint8_t *)codes->data, (int)q->shape[0],
                                         (const float *)q->data, b->p, (uint32_t *)j->indices->data,
                                         sc, &j->nout);
}

/* With at least as many jobs as threads, each job runs on one thread and
 * the threads share the jobs: one fork and join for the batch, where a
 * search split over threads pays one per job (and needs long ranges to gain
 * from it). Fewer jobs: one after the other, each on every thread. */
static int cpu_search_batch(kvd_backend *be, kvd_pq_search_job *jobs, int64_t njobs,
                            const kvd_pq_search_params *p, kvd_error *err)
{
    int nt = kvd__cpu_threads(be);
    if (nt < 2 || njobs < nt || njobs > INT32_MAX) {
        for (int64_t i = 0; i < njobs; i++) {
            kvd_pq_search_job *j = &jobs[i];
            int rc = j->fill ? j->fill(j->fill_arg) : 0;
            if (rc)
                return kvd_error_set(err, rc, "pq: filling the codes of job %lld: %s", (long long)i,
                                     kvd_strerror(rc));
            rc = cpu_search(be, j->centroids, j->codes, j->queries, p, j->indices, j->scores,
                            &j->nout, err);
            if (rc)
                return rc;
        }
        return KVD_OK;
    }
    int *rcs = calloc((size_t)njobs, sizeof(int));
    unsigned char *fill_failed = calloc((size_t)njobs, 1);
    if (!rcs || !fill_failed) {
        free(rcs);
        free(fill_failed);
        return kvd_error_set(err, KVD_ENOMEM, "pq: search: out of memory");
    }
    batch_job b = {be, jobs, p, rcs, fill_failed};
    kvd__par_for((int)njobs, nt, batch_part, &b);
    int rc = KVD_OK;
    for (int64_t i = 0; i < njobs && rc == KVD_OK; i++)
        if (rcs[i])
            rc = kvd_error_set(err, rcs[i], "pq: %s of job %lld: %s",
                               fill_failed[i] ? "filling the codes" : "search", (long long)i,
                               kvd_strerror(rcs[i]));
    free(rcs);
    free(fill_failed);
    return rc;
}

const struct kvd_pq_ops kvd__cpu_pq_ops = {
    .train = cpu_train,
    .encode = cpu_encode,
    .search = cpu_search,
    .search_batch = cpu_search_batch,
};

static int get_ops(kvd_backend *be, const struct kvd_pq_ops **ops, kvd_error *err)
{
    if (!be || !be->iface)
        return kvd_error_set(err, KVD_EINVAL, "pq: backend is NULL");
    *ops = be->iface->pq;
    if (!*ops)
        return kvd_error_set(err, KVD_EUNSUPP, "pq: not supported by the %s backend",
                             be->iface->name);
    return KVD_OK;
}

int kvd_pq_train(kvd_backend *be, const kvd_tensor *keys, const kvd_kmeans_params *km,
                 kvd_tensor *centroids, kvd_error *err)
{
    const struct kvd_pq_ops *ops;
    pq_shape sh = {0};
    int rc = get_ops(be, &ops, err);
    if (rc)
        return rc;
    if (!ops->train)
        return kvd_error_set(err, KVD_EUNSUPP, "pq: train not supported by the %s backend",
                             be->iface->name);
    if (!km || km->niter < 0 || km->max_points < 0)
        return kvd_error_set(err, KVD_EINVAL, "pq: train needs niter >= 0 and max_points >= 0");
    if ((rc = check_centroids(centroids, &sh, err)) || (rc = check_mat(keys, KVD_DTYPE_F32, sh.D, "keys", err)))
        return rc;
    if (keys->shape[0] < 1)
        return kvd_error_set(err, KVD_EINVAL, "pq: train needs at least one key");
    return ops->train(be, keys, km, centroids, err);
}

int kvd_pq_encode(kvd_backend *be, const kvd_tensor *keys, const kvd_tensor *centroids,
                  kvd_tensor *codes, kvd_error *err)
{
    const struct kvd_pq_ops *ops;
    pq_shape sh = {0};
    int rc = get_ops(be, &ops, err);
    if (rc)
        return rc;
    if (!ops->encode)
        return kvd_error_set(err, KVD_EUNSUPP, "pq: encode not supported by the %s backend",
                             be->iface->name);
    if ((rc = check_centroids(centroids, &sh, err)) || (rc = check_mat(keys, KVD_DTYPE_F32, sh.D, "keys", err)) ||
        (rc = check_mat(codes, KVD_DTYPE_U8, sh.m, "codes", err)))
        return rc;
    if (codes->shape[0] != keys->shape[0])
        return kvd_error_set(err, KVD_EINVAL, "pq: codes has %lld rows, keys %lld",
                             (long long)codes->shape[0], (long long)keys->shape[0]);
    return ops->encode(be, keys, centroids, codes, err);
}

int kvd_pq_search(kvd_backend *be, const kvd_tensor *centroids, const kvd_tensor *codes,
                  const kvd_tensor *queries, const kvd_pq_search_params *p,
                  kvd_tensor *indices, kvd_tensor *scores, int64_t *nout, kvd_error *err)
{
    const struct kvd_pq_ops *ops;
    pq_shape sh = {0};
    if (nout)
        *nout = 0;
    int rc = get_ops(be, &ops, err);
    if (rc)
        return rc;
    if (!ops->search)
        return kvd_error_set(err, KVD_EUNSUPP, "pq: search not supported by the %s backend",
                             be->iface->name);
    if (!p || !nout || p->k < 0 || p->sink < 0 || p->window < 0 ||
        (p->agg != KVD_PQ_AGG_SUM && p->agg != KVD_PQ_AGG_MAX))
        return kvd_error_set(err, KVD_EINVAL,
                             "pq: search needs params with k, sink, window >= 0, a known agg, nout");
    if ((rc = check_centroids(centroids, &sh, err)) ||
        (rc = check_mat(codes, KVD_DTYPE_U8, sh.m, "codes", err)) ||
        (rc = check_mat(queries, KVD_DTYPE_F32, sh.D, "queries", err)))
        return rc;
    if (queries->shape[0] < 1 || queries->shape[0] > 4096)
        return kvd_error_set(err, KVD_EINVAL, "pq: search needs 1..4096 query heads, got %lld",
                             (long long)queries->shape[0]);
    if (codes->shape[0] > (int64_t)UINT32_MAX)
        return kvd_error_set(err, KVD_EINVAL, "pq: more than 2^32-1 tokens");
    int64_t need = kvd_pq_search_count(codes->shape[0], p);
    if (!indices || indices->dtype != KVD_DTYPE_U32 || indices->ndim != 1 ||
        !kvd_tensor_is_contiguous(indices) || indices->shape[0] < need ||
        (need > 0 && !indices->data))
        return kvd_error_set(err, KVD_EINVAL,
                             "pq: indices must be a contiguous u32 vector of >= %lld entries",
                             (long long)need);
    if (scores && (scores->dtype != KVD_DTYPE_F32 || scores->ndim != 1 ||
                   !kvd_tensor_is_contiguous(scores) || scores->shape[0] < need ||
                   (need > 0 && !scores->data)))
        return kvd_error_set(err, KVD_EINVAL,
                             "pq: scores must be a contiguous f32 vector of >= %lld entries",
                             (long long)need);
    return ops->search(be, centroids, codes, queries, p, indices, scores, nout, err);
}

/* ---- batched search ----------------------------------------------------- */

/* The checks of kvd_pq_search() for one job, plus the batch's common shape. */
static int check_job(const kvd_pq_search_job *j, int64_t i, const kvd_pq_search_params *p,
                     const pq_shape *first, int64_t G0, kvd_error *err)
{
    pq_shape sh = {0};
    int rc;
    if (!j->centroids || !j->codes || !j->queries || !j->indices)
        return kvd_error_set(err, KVD_EINVAL, "pq: batch job %lld has a NULL tensor", (long long)i);
    if ((rc = check_centroids(j->centroids, &sh, err)) ||
        (rc = check_mat(j->codes, KVD_DTYPE_U8, sh.m, "codes", err)) ||
        (rc = check_mat(j->queries, KVD_DTYPE_F32, sh.D, "queries", err)))
        return rc;
    if (sh.m != first->m || sh.b != first->b || sh.D != first->D || j->queries->shape[0] != G0)
        return kvd_error_set(err, KVD_EINVAL,
                             "pq: batch job %lld has another shape than job 0 (m, b, D, G)",
                             (long long)i);
    if (G0 < 1 || G0 > 4096)
        return kvd_error_set(err, KVD_EINVAL, "pq: search needs 1..4096 query heads, got %lld",
                             (long long)G0);
    if (j->codes->shape[0] > (int64_t)UINT32_MAX)
        return kvd_error_set(err, KVD_EINVAL, "pq: more than 2^32-1 tokens");
    int64_t need = kvd_pq_search_count(j->codes->shape[0], p);
    const kvd_tensor *ix = j->indices, *sc = j->scores;
    if (ix->dtype != KVD_DTYPE_U32 || ix->ndim != 1 || !kvd_tensor_is_contiguous(ix) ||
        ix->shape[0] < need || (need > 0 && !ix->data))
        return kvd_error_set(err, KVD_EINVAL,
                             "pq: batch job %lld: indices must be a contiguous u32 vector of >= %lld entries",
                             (long long)i, (long long)need);
    if (sc && (sc->dtype != KVD_DTYPE_F32 || sc->ndim != 1 || !kvd_tensor_is_contiguous(sc) ||
               sc->shape[0] < need || (need > 0 && !sc->data)))
        return kvd_error_set(err, KVD_EINVAL,
                             "pq: batch job %lld: scores must be a contiguous f32 vector of >= %lld entries",
                             (long long)i, (long long)need);
    return KVD_OK;
}

int kvd_pq_search_batch(kvd_backend *be, kvd_pq_search_job *jobs, int64_t njobs,
                        const kvd_pq_search_params *p, kvd_error *err)
{
    const struct kvd_pq_ops *ops;
    int rc = get_ops(be, &ops, err);
    if (rc)
        return rc;
    if (njobs < 0 || (njobs > 0 && !jobs))
        return kvd_error_set(err, KVD_EINVAL, "pq: batch needs njobs >= 0 and a job array");
    for (int64_t i = 0; i < njobs; i++)
        jobs[i].nout = 0;
    if (!p || p->k < 0 || p->sink < 0 || p->window < 0 ||
        (p->agg != KVD_PQ_AGG_SUM && p->agg != KVD_PQ_AGG_MAX))
        return kvd_error_set(err, KVD_EINVAL,
                             "pq: search needs params with k, sink, window >= 0 and a known agg");
    if (njobs == 0)
        return KVD_OK;
    pq_shape first;
    if (!jobs[0].centroids || !jobs[0].queries)
        return kvd_error_set(err, KVD_EINVAL, "pq: batch job 0 has a NULL tensor");
    if ((rc = check_centroids(jobs[0].centroids, &first, err)))
        return rc;
    for (int64_t i = 0; i < njobs; i++)
        if ((rc = check_job(&jobs[i], i, p, &first, jobs[0].queries->shape[0], err)))
            return rc;
    /* the CPU's batch fills each job on the thread that searches it; other
     * backends get their codes filled here, before the batch */
    for (int64_t i = 0; ops->search_batch != cpu_search_batch && i < njobs; i++)
        if (jobs[i].fill && (rc = jobs[i].fill(jobs[i].fill_arg)) != 0)
            return kvd_error_set(err, rc, "pq: filling the codes of job %lld: %s", (long long)i,
                                 kvd_strerror(rc));
    if (!ops->search_batch) { /* backends without a batched kernel: one search each */
        if (!ops->search)
            return kvd_error_set(err, KVD_EUNSUPP, "pq: search not supported by the %s backend",
                                 be->iface->name);
        for (int64_t i = 0; i < njobs; i++) {
            kvd_pq_search_job *j = &jobs[i];
            rc = ops->search(be, j->centroids, j->codes, j->queries, p, j->indices, j->scores,
                             &j->nout, err);
            if (rc) {
                for (int64_t t = 0; t < njobs; t++)
                    jobs[t].nout = 0;
                return rc;
            }
        }
        return KVD_OK;
    }
    rc = ops->search_batch(be, jobs, njobs, p, err);
    if (rc)
        for (int64_t i = 0; i < njobs; i++)
            jobs[i].nout = 0;
    return rc;
}
