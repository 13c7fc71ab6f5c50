/*
 * PQ index on the GPU: train, encode and batched top-k search (semantics in
 * kvdepot/pq.h). Scores are the CPU's floats bit for bit (same table
 * formula, same summation order, no contraction) and the selection is
 * exact on the same (score, index) ordering keys, so results equal the CPU
 * reference's; tests still allow for ties.
 *
 * Ordering key of a token: u64 = order-preserving u32 of its score (NaN ->
 * 0, -0 -> +0) << 32 | ~index. Larger key = better; all keys distinct.
 *
 * Search of a batch of J jobs (each one (sequence, kv head) pair, same m,
 * b, D, G), five launches whatever J is (plus one per 32 jobs to stage the table):
 *
 *   0. jobs     the job table, passed as kernel parameters (no host sync).
 *   1. lut      grid (J, ntab), 256 threads. ntab = 1 (SUM: the G queries
 *               summed in head order) or G (MAX). Thread per table entry
 *               (j, c): LUT[j][c] = sequential sum over t of q[j*dsub+t] *
 *               C[j][c][t]; entries c >= 2^b are -inf. (J, ntab, m, 256) f32.
 *   2. scan     grid (ceil(nmax / 4096), J), 256 threads, 16 tokens per
 *               thread in steps of 256 (coalesced: a warp reads 32
 *               consecutive code rows). The job's tables are staged in
 *               shared memory (ntab*m KiB; read from global memory when
 *               over 48 KiB). Each token's m code bytes are one vector load
 *               when m is 2, 4, 8 or 16 (m = 1 and others: byte loads).
 *               Writes the u32 key of every token and a 2048-bin histogram
 *               of the top 11 key bits over the middle tokens (shared
 *               atomics, flushed with one global atomic per non-empty bin).
 *   3. bucket   one warp per job: the bin B holding the k-th best middle
 *               token and the count above it.
 *   4. filter   grid as scan: middle tokens with bin > B go straight to the
 *               job's output list, bin == B to a candidate list (global
 *               atomics on per-job counters).
 *   5. select   one 1024-thread block per job: exact radix select (8 bits
 *               a pass, 64-bit keys) of the r = k - above best candidates,
 *               the forced sink/window tokens appended, then a bitonic
 *               sort (descending) of the <= cap entries, in shared memory
 *               when cap <= 4096 (every k <= 2048 with <= 2048 forced
 *               tokens), otherwise in place in global memory; indices and
 *               scores (decoded from the keys, as the CPU does) written.
 *
 * Scratch (one stream-ordered allocation per call): job table, tables,
 * keys (4 B/token), candidates (8 B per middle token, worst case), output
 * lists, histograms and counters.
 */
#include <stdlib.h>
#include <string.h>

#include <type_traits>

#include "cuda_internal.h"

namespace {

constexpr int kScanThreads = 256;
constexpr int kTokensPerThread = 16;
constexpr int kTokensPerBlock = kScanThreads * kTokensPerThread;
constexpr int kBins = 2048;
constexpr int kBinShift = 21; /* 32 - 11 */
constexpr int kSelectThreads = 1024;
constexpr int kSmemSortCap = 4096;
constexpr size_t kSmemLutBytes = 40 << 10; /* + 8 KiB histogram: under the 48 KiB default */

struct job_desc {
    const float *cent;
    const uint8_t *codes;
    const float *q;
    uint32_t *idx;
    float *scores;
    long long n, s, w, kk, total, cap;
    long long key_off, cand_off, out_off;
};

/* Per-job counters, zeroed with the histograms. */
struct job_ctr {
    int bucket;              /* B: -1 = every middle token, kBins = none */
    unsigned long long above; /* middle tokens with bin > B */
    unsigned long long nout;  /* filled by filter */
    unsigned long long ncand;
};

__device__ __forceinline__ uint32_t key_ord(float s)
{
    if (isnan(s))
        return 0;
    if (s == 0.0f)
        s = 0.0f;
    uint32_t u = __float_as_uint(s);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ float key_unord(uint32_t o)
{
    uint32_t u = (o & 0x80000000u) ? (o & 0x7FFFFFFFu) : ~o;
    return __uint_as_float(u);
}

__device__ __forceinline__ unsigned long long make_key(uint32_t k32, long long i)
{
    return ((unsigned long long)k32 << 32) | (unsigned long long)(~(uint32_t)i);
}

/* ---- 0. job table -------------------------------------------------------- */

/* Job descriptors travel as kernel parameters (32 per launch, 3 KiB) and
 * this kernel stores them into the scratch table. A cudaMemcpyAsync from
 * pageable host memory would first wait for the stream to drain, which
 * would serialise the host with every earlier search; a launch does not. */
constexpr int kJobsPerStage = 32;
struct job_stage {
    job_desc d[kJobsPerStage];
};

__global__ void stage_jobs_kernel(const __grid_constant__ job_stage st, job_desc *dst, int count)
{
    if ((int)threadIdx.x < count)
        dst[threadIdx.x] = st.d[threadIdx.x];
}

/* ---- 1. tables ---------------------------------------------------------- */

__global__ void lut_kernel(const job_desc *jobs, float *luts, int m, int ksub, int D, int G,
                           int ntab)
{
    extern __shared__ float qv[];
    const job_desc jb = jobs[blockIdx.x];
    const int h = blockIdx.y, dsub = D / m;
    for (int t = threadIdx.x; t < D; t += blockDim.x) {
        float s;
        if (ntab == 1) { /* SUM: q_0 + ... + q_{G-1}, in that order */
            s = jb.q[t];
            for (int g = 1; g < G; g++)
                s = __fadd_rn(s, jb.q[(long long)g * D + t]);
        } else {
            s = jb.q[(long long)h * D + t];
        }
        qv[t] = s;
    }
    __syncthreads();
    float *lut = luts + ((long long)blockIdx.x * ntab + h) * m * 256;
    for (int e = threadIdx.x; e < m * 256; e += blockDim.x) {
        const int j = e / 256, c = e % 256;
        if (c >= ksub) {
            lut[e] = -INFINITY;
            continue;
        }
        const float *cc = jb.cent + ((long long)j * ksub + c) * dsub;
        const float *qj = qv + j * dsub;
        float acc = 0.0f;
        for (int t = 0; t < dsub; t++)
            acc = __fadd_rn(acc, __fmul_rn(qj[t], cc[t]));
        lut[e] = acc;
    }
}

/* ---- 2. scan ------------------------------------------------------------ */

/* The m code bytes of one token into registers. */
template <int M>
__device__ __forceinline__ void load_codes(const uint8_t *row, uint8_t (&c)[M > 0 ? M : 1])
{
    if constexpr (M == 2) {
        uint16_t v = *reinterpret_cast<const uint16_t *>(row);
        c[0] = v & 0xff;
        c[1] = v >> 8;
    } else if constexpr (M == 4 || M == 8 || M == 16) {
        using vec = typename std::conditional<M == 4, uint32_t,
                    typename std::conditional<M == 8, uint2, uint4>::type>::type;
        vec v = *reinterpret_cast<const vec *>(row);
        const uint8_t *b = reinterpret_cast<const uint8_t *>(&v);
#pragma unroll
        for (int j = 0; j < M; j++)
            c[j] = b[j];
    } else {
#pragma unroll
        for (int j = 0; j < (M > 0 ? M : 1); j++)
            c[j] = row[j];
    }
}

/* Score of one token: tables h = 0..ntab-1, SUM (ntab 1) or MAX rule. */
template <int M>
__device__ __forceinline__ float score_token(const uint8_t *row, int m, const float *lut,
                                             int ntab)
{
    float best = 0.0f;
    for (int h = 0; h < ntab; h++) {
        const float *t = lut + h * m * 256;
        float s;
        if constexpr (M > 0) {
            uint8_t c[M];
            load_codes<M>(row, c);
            s = t[c[0]];
#pragma unroll
            for (int j = 1; j < M; j++)
                s = __fadd_rn(s, t[j * 256 + c[j]]);
        } else {
            s = t[row[0]];
            for (int j = 1; j < m; j++)
                s = __fadd_rn(s, t[j * 256 + row[j]]);
        }
        if (h == 0 || isnan(best) || s > best)
            best = s;
    }
    return best;
}

template <int M>
__global__ void __launch_bounds__(kScanThreads)
    scan_kernel(const job_desc *jobs, const float *luts, uint32_t *keys, uint32_t *hist, int m,
                int ntab, int lut_in_smem)
{
    extern __shared__ float slut[];
    __shared__ uint32_t shist[kBins];
    const job_desc jb = jobs[blockIdx.y];
    const long long i0 = (long long)blockIdx.x * kTokensPerBlock;
    if (i0 >= jb.n)
        return;
    const float *glut = luts + (long long)blockIdx.y * ntab * m * 256;
    const float *lut = glut;
    if (lut_in_smem) {
        for (int e = threadIdx.x; e < ntab * m * 256; e += blockDim.x)
            slut[e] = glut[e];
        lut = slut;
    }
    for (int b = threadIdx.x; b < kBins; b += blockDim.x)
        shist[b] = 0;
    __syncthreads();
    const long long lo = jb.s, hi = jb.n - jb.w;
    uint32_t *k = keys + jb.key_off;
#pragma unroll 4
    for (int r = 0; r < kTokensPerThread; r++) {
        const long long i = i0 + r * kScanThreads + threadIdx.x;
        if (i < jb.n) {
            const uint32_t key = key_ord(score_token<M>(jb.codes + i * m, m, lut, ntab));
            k[i] = key;
            if (i >= lo && i < hi)
                atomicAdd(&shist[key >> kBinShift], 1u);
        }
    }
    __syncthreads();
    uint32_t *gh = hist + (long long)blockIdx.y * kBins;
    for (int b = threadIdx.x; b < kBins; b += blockDim.x)
        if (shist[b])
            atomicAdd(&gh[b], shist[b]);
}

/* ---- 3. bucket ---------------------------------------------------------- */

__global__ void bucket_kernel(const job_desc *jobs, const uint32_t *hist, job_ctr *ctr, int njobs)
{
    const int jid = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const int lane = threadIdx.x & 31;
    if (jid >= njobs)
        return;
    const job_desc jb = jobs[jid];
    const long long mid = jb.n - jb.s - jb.w;
    job_ctr *c = &ctr[jid];
    if (jb.kk <= 0) {
        if (lane == 0)
            c->bucket = kBins;
        return;
    }
    if (jb.kk >= mid) {
        if (lane == 0)
            c->bucket = -1;
        return;
    }
    /* Walk the bins from the top, 32 at a time: lane l holds bin top-l. */
    const uint32_t *h = hist + (long long)jid * kBins;
    unsigned long long cum = 0;
    for (int base = kBins - 1; base >= 0; base -= 32) {
        const int bin = base - lane;
        unsigned long long v = bin >= 0 ? h[bin] : 0;
        /* inclusive prefix over lanes (lane 0 = highest bin) */
        unsigned long long incl = v;
        for (int o = 1; o < 32; o <<= 1) {
            unsigned long long t = __shfl_up_sync(0xffffffffu, incl, o);
            if (lane >= o)
                incl += t;
        }
        const unsigned hit = __ballot_sync(0xffffffffu, cum + incl >= (unsigned long long)jb.kk);
        if (hit) {
            const int first = __ffs(hit) - 1;
            if (lane == first) {
                c->bucket = bin;
                c->above = cum + incl - v;
            }
            return;
        }
        cum += __shfl_sync(0xffffffffu, incl, 31);
    }
}

/* ---- 4. filter ---------------------------------------------------------- */

__global__ void __launch_bounds__(kScanThreads)
    filter_kernel(const job_desc *jobs, const uint32_t *keys, job_ctr *ctr,
                  unsigned long long *cand, unsigned long long *outl)
{
    const job_desc jb = jobs[blockIdx.y];
    const int B = ctr[blockIdx.y].bucket;
    const long long lo = jb.s, hi = jb.n - jb.w;
    const long long i0 = lo + (long long)blockIdx.x * kTokensPerBlock;
    if (B >= kBins || i0 >= hi)
        return;
    const uint32_t *k = keys + jb.key_off;
    job_ctr *c = &ctr[blockIdx.y];
    for (int r = 0; r < kTokensPerThread; r++) {
        const long long i = i0 + r * kScanThreads + threadIdx.x;
        if (i >= hi)
            break;
        const uint32_t key = k[i];
        const int bin = (int)(key >> kBinShift);
        if (bin > B)
            outl[jb.out_off + atomicAdd(&c->nout, 1ull)] = make_key(key, i);
        else if (bin == B)
            cand[jb.cand_off + atomicAdd(&c->ncand, 1ull)] = make_key(key, i);
    }
}

/* ---- 5. select, forced tokens, sort ------------------------------------- */

__device__ void bitonic_desc(unsigned long long *a, int cap)
{
    for (int size = 2; size <= cap; size <<= 1) {
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            for (int i = threadIdx.x; i < cap / 2; i += blockDim.x) {
                const int lo = 2 * stride * (i / stride) + (i % stride), hi = lo + stride;
                const bool desc = (lo & size) == 0;
                const unsigned long long x = a[lo], y = a[hi];
                if ((x < y) == desc) {
                    a[lo] = y;
                    a[hi] = x;
                }
            }
            __syncthreads();
        }
    }
}

__global__ void __launch_bounds__(kSelectThreads)
    select_kernel(const job_desc *jobs, const uint32_t *keys, job_ctr *ctr,
                  unsigned long long *cand, unsigned long long *outl)
{
    __shared__ unsigned long long sort_buf[kSmemSortCap];
    __shared__ uint32_t dh[256];
    __shared__ unsigned long long s_prefix, s_r, s_pos;
    const job_desc jb = jobs[blockIdx.x];
    job_ctr *c = &ctr[blockIdx.x];
    unsigned long long *out = outl + jb.out_off;
    const unsigned long long *cd = cand + jb.cand_off;
    const uint32_t *k = keys + jb.key_off;

    /* exact selection of the r best candidates */
    const unsigned long long ncand = c->ncand;
    if (threadIdx.x == 0) {
        const long long r = c->bucket >= 0 && c->bucket < kBins ? jb.kk - (long long)c->above : 0;
        s_r = r > 0 ? (unsigned long long)r : 0;
        s_prefix = 0;
        s_pos = c->nout;
    }
    __syncthreads();
    const unsigned long long r0 = s_r;
    if (r0 > 0 && r0 < ncand) {
        unsigned long long mask = 0;
        for (int shift = 56; shift >= 0; shift -= 8) {
            for (int b = threadIdx.x; b < 256; b += blockDim.x)
                dh[b] = 0;
            __syncthreads();
            const unsigned long long prefix = s_prefix;
            for (unsigned long long i = threadIdx.x; i < ncand; i += blockDim.x) {
                const unsigned long long key = cd[i];
                if ((key & mask) == prefix)
                    atomicAdd(&dh[(key >> shift) & 255], 1u);
            }
            __syncthreads();
            if (threadIdx.x == 0) {
                unsigned long long cum = 0, r = s_r;
                for (int dig = 255; dig >= 0; dig--) {
                    if (cum + dh[dig] >= r) {
                        s_prefix = prefix | ((unsigned long long)dig << shift);
                        s_r = r - cum;
                        break;
                    }
                    cum += dh[dig];
                }
            }
            mask |= 255ull << shift;
            __syncthreads();
        }
    }
    /* s_prefix is now the r0-th best candidate (0 when all are taken) */
    const unsigned long long thr = r0 > 0 && r0 < ncand ? s_prefix : 0;
    if (r0 > 0)
        for (unsigned long long i = threadIdx.x; i < ncand; i += blockDim.x)
            if (cd[i] >= thr)
                out[atomicAdd(&s_pos, 1ull)] = cd[i];
    /* forced tokens after the kk selected ones */
    const long long nw0 = jb.n - jb.w;
    for (long long i = threadIdx.x; i < jb.s + jb.w; i += blockDim.x) {
        const long long tok = i < jb.s ? i : nw0 + (i - jb.s);
        out[jb.kk + i] = make_key(k[tok], tok);
    }
    __syncthreads();
    const int cap = (int)jb.cap;
    unsigned long long *a = out;
    if (cap <= kSmemSortCap) {
        for (int i = threadIdx.x; i < cap; i += blockDim.x)
            sort_buf[i] = i < jb.total ? out[i] : 0ull;
        a = sort_buf;
    } else {
        for (long long i = jb.total + threadIdx.x; i < cap; i += blockDim.x)
            out[i] = 0ull; /* below every real key: sorts last */
    }
    __syncthreads();
    bitonic_desc(a, cap);
    for (long long i = threadIdx.x; i < jb.total; i += blockDim.x) {
        const unsigned long long key = a[i];
        jb.idx[i] = ~(uint32_t)key;
        if (jb.scores)
            jb.scores[i] = key_unord((uint32_t)(key >> 32));
    }
}

/* ---- host side ---------------------------------------------------------- */

long long pow2_at_least(long long x)
{
    long long p = 2;
    while (p < x)
        p <<= 1;
    return p;
}

size_t align_up(size_t x) { return (x + 255) & ~(size_t)255; }

template <int M>
void launch_scan(dim3 grid, size_t smem, cudaStream_t s, const job_desc *jobs, const float *luts,
                 uint32_t *keys, uint32_t *hist, int m, int ntab, int in_smem)
{
    scan_kernel<M><<<grid, kScanThreads, smem, s>>>(jobs, luts, keys, hist, m, ntab, in_smem);
}

int run_search(kvd_backend *be, kvd_pq_search_job *jobs, int64_t njobs,
               const kvd_pq_search_params *p, kvd_error *err)
{
    kvd_cuda_call call;
    int rc = kvd__cuda_begin(be, &call, err);
    if (rc)
        return rc;
    const kvd_tensor *c0 = jobs[0].centroids;
    const int m = (int)c0->shape[0], ksub = (int)c0->shape[1], D = (int)(m * c0->shape[2]);
    const int G = (int)jobs[0].queries->shape[0];
    const int ntab = p->agg == KVD_PQ_AGG_MAX ? G : 1;
    if (njobs > 65535)
        return kvd_error_set(err, KVD_EINVAL, "cuda: pq: at most 65535 searches per batch");
    if ((size_t)D * sizeof(float) > (48 << 10))
        return kvd_error_set(err, KVD_EUNSUPP, "cuda: pq: head_dim %d is over 12288", D);

    job_desc *hd = (job_desc *)calloc((size_t)njobs, sizeof(job_desc));
    if (!hd)
        return kvd_error_set(err, KVD_ENOMEM, "cuda: pq: out of host memory");
    long long keys_n = 0, cand_n = 0, out_n = 0, nmax = 0;
    for (int64_t i = 0; i < njobs; i++) {
        job_desc *d = &hd[i];
        const long long n = jobs[i].codes->shape[0];
        const long long s = p->sink < n ? p->sink : n;
        const long long w = p->window < n - s ? p->window : n - s;
        const long long mid = n - s - w;
        d->cent = (const float *)jobs[i].centroids->data;
        d->codes = (const uint8_t *)jobs[i].codes->data;
        d->q = (const float *)jobs[i].queries->data;
        d->idx = (uint32_t *)jobs[i].indices->data;
        d->scores = jobs[i].scores ? (float *)jobs[i].scores->data : NULL;
        d->n = n, d->s = s, d->w = w;
        d->kk = p->k < mid ? p->k : mid;
        d->total = s + w + d->kk;
        d->cap = pow2_at_least(d->total);
        d->key_off = keys_n, d->cand_off = cand_n, d->out_off = out_n;
        keys_n += n, cand_n += mid, out_n += d->cap;
        nmax = n > nmax ? n : nmax;
        jobs[i].nout = d->total;
    }
    const size_t lut_bytes = (size_t)ntab * m * 256 * sizeof(float);
    size_t off_jobs = 0, off_lut = align_up(off_jobs + sizeof(job_desc) * njobs);
    size_t off_keys = align_up(off_lut + lut_bytes * njobs);
    size_t off_hist = align_up(off_keys + sizeof(uint32_t) * keys_n);
    size_t off_ctr = align_up(off_hist + sizeof(uint32_t) * kBins * njobs);
    size_t off_cand = align_up(off_ctr + sizeof(job_ctr) * njobs);
    size_t off_out = align_up(off_cand + sizeof(unsigned long long) * cand_n);
    size_t total = align_up(off_out + sizeof(unsigned long long) * out_n);
    char *scr = NULL;
    if ((rc = kvd__cuda_scratch(&call, total, (void **)&scr, err))) {
        free(hd);
        return rc;
    }
    job_desc *djobs = (job_desc *)(scr + off_jobs);
    float *luts = (float *)(scr + off_lut);
    uint32_t *keys = (uint32_t *)(scr + off_keys), *hist = (uint32_t *)(scr + off_hist);
    job_ctr *ctr = (job_ctr *)(scr + off_ctr);
    unsigned long long *cand = (unsigned long long *)(scr + off_cand);
    unsigned long long *outl = (unsigned long long *)(scr + off_out);

    for (int64_t j0 = 0; j0 < njobs; j0 += kJobsPerStage) {
        job_stage st;
        const int cnt = (int)(njobs - j0 < kJobsPerStage ? njobs - j0 : kJobsPerStage);
        memcpy(st.d, hd + j0, sizeof(job_desc) * (size_t)cnt);
        stage_jobs_kernel<<<1, kJobsPerStage, 0, call.s>>>(st, djobs + j0, cnt);
    }
    rc = kvd__cuda_launched(&call, "pq jobs", err);
    if (!rc)
        rc = kvd__cuda_status(call.c, cudaMemsetAsync(scr + off_hist, 0, off_cand - off_hist, call.s),
                              "cudaMemsetAsync", err);
    int aligned = 1;
    for (int64_t i = 0; i < njobs; i++)
        if (((uintptr_t)hd[i].codes % (unsigned)(m >= 16 ? 16 : m)) != 0)
            aligned = 0;
    free(hd);
    if (rc)
        goto out;
    lut_kernel<<<dim3((unsigned)njobs, (unsigned)ntab), 256, sizeof(float) * D, call.s>>>(
        djobs, luts, m, ksub, D, G, ntab);
    if ((rc = kvd__cuda_launched(&call, "pq lut", err)))
        goto out;
    if (nmax > 0) {
        const dim3 grid((unsigned)((nmax + kTokensPerBlock - 1) / kTokensPerBlock),
                        (unsigned)njobs);
        const int in_smem = lut_bytes <= kSmemLutBytes;
        const size_t smem = in_smem ? lut_bytes : 0;
        const int M = aligned ? m : 0;
        switch (M) {
        case 1: launch_scan<1>(grid, smem, call.s, djobs, luts, keys, hist, m, ntab, in_smem); break;
        case 2: launch_scan<2>(grid, smem, call.s, djobs, luts, keys, hist, m, ntab, in_smem); break;
        case 4: launch_scan<4>(grid, smem, call.s, djobs, luts, keys, hist, m, ntab, in_smem); break;
        case 8: launch_scan<8>(grid, smem, call.s, djobs, luts, keys, hist, m, ntab, in_smem); break;
        case 16: launch_scan<16>(grid, smem, call.s, djobs, luts, keys, hist, m, ntab, in_smem); break;
        default: launch_scan<0>(grid, smem, call.s, djobs, luts, keys, hist, m, ntab, in_smem);
        }
        if ((rc = kvd__cuda_launched(&call, "pq scan", err)))
            goto out;
        bucket_kernel<<<(unsigned)((njobs + 7) / 8), 256, 0, call.s>>>(djobs, hist, ctr,
                                                                      (int)njobs);
        if ((rc = kvd__cuda_launched(&call, "pq bucket", err)))
            goto out;
        filter_kernel<<<grid, kScanThreads, 0, call.s>>>(djobs, keys, ctr, cand, outl);
        if ((rc = kvd__cuda_launched(&call, "pq filter", err)))
            goto out;
        select_kernel<<<(unsigned)njobs, kSelectThreads, 0, call.s>>>(djobs, keys, ctr, cand,
                                                                      outl);
        rc = kvd__cuda_launched(&call, "pq select", err);
    }
out:
    kvd__cuda_scratch_free(&call, scr);
    return rc;
}

int cuda_search_batch(kvd_backend *be, kvd_pq_search_job *jobs, int64_t njobs,
                      const kvd_pq_search_params *p, kvd_error *err)
{
    /* The select block sorts up to pow2(n) keys with int indices: refuse
     * indexes over 2^30 tokens explicitly rather than mis-index. */
    for (int64_t i = 0; i < njobs; i++)
        if (jobs[i].codes->shape[0] > ((int64_t)1 << 30))
            return kvd_error_set(err, KVD_EUNSUPP, "cuda: pq: search over more than 2^30 tokens");
    return run_search(be, jobs, njobs, p, err);
}

int cuda_search(kvd_backend *be, const kvd_tensor *centroids, const kvd_tensor *codes,
                const kvd_tensor *queries, const kvd_pq_search_params *p, kvd_tensor *indices,
                kvd_tensor *scores, int64_t *nout, kvd_error *err)
{
    kvd_pq_search_job job = {centroids, codes, queries, indices, scores, 0, NULL, NULL};
    int rc = cuda_search_batch(be, &job, 1, p, err);
    *nout = rc ? 0 : job.nout;
    return rc;
}

/* ---- encode and train --------------------------------------------------- */

/* Thread per (token, sub-space): nearest centroid by the direct squared
 * distance in the CPU's order (bitwise its codes; ties to the lower index). */
__global__ void encode_kernel(long long n, int m, int ksub, int dsub, const float *keys,
                              const float *cent, uint8_t *codes)
{
    for (long long e = blockIdx.x * (long long)blockDim.x + threadIdx.x; e < n * m;
         e += (long long)gridDim.x * blockDim.x) {
        const long long i = e / m;
        const int j = (int)(e % m);
        const float *x = keys + i * (long long)m * dsub + (long long)j * dsub;
        const float *cj = cent + (long long)j * ksub * dsub;
        float best = INFINITY;
        int bi = 0;
        for (int c = 0; c < ksub; c++) {
            float acc = 0.0f;
            for (int t = 0; t < dsub; t++) {
                float diff = __fsub_rn(x[t], cj[c * dsub + t]);
                acc = __fadd_rn(acc, __fmul_rn(diff, diff));
            }
            if (acc < best) {
                best = acc;
                bi = c;
            }
        }
        codes[e] = (uint8_t)bi;
    }
}

int cuda_encode(kvd_backend *be, const kvd_tensor *keys, const kvd_tensor *centroids,
                kvd_tensor *codes, kvd_error *err)
{
    kvd_cuda_call call;
    int rc = kvd__cuda_begin(be, &call, err);
    if (rc)
        return rc;
    const long long n = keys->shape[0];
    const int m = (int)centroids->shape[0], ksub = (int)centroids->shape[1];
    const int dsub = (int)centroids->shape[2];
    if (n == 0)
        return KVD_OK;
    encode_kernel<<<kvd__cuda_blocks(n * m, 256), 256, 0, call.s>>>(
        n, m, ksub, dsub, (const float *)keys->data, (const float *)centroids->data,
        (uint8_t *)codes->data);
    return kvd__cuda_launched(&call, "pq encode", err);
}

int cuda_train(kvd_backend *be, const kvd_tensor *keys, const kvd_kmeans_params *km,
               kvd_tensor *centroids, kvd_error *err)
{
    kvd_cuda_call call;
    int rc = kvd__cuda_begin(be, &call, err);
    if (rc)
        return rc;
    const long long n = keys->shape[0];
    const int m = (int)centroids->shape[0], ksub = (int)centroids->shape[1];
    const int dsub = (int)centroids->shape[2], D = m * dsub;
    const float *x = (const float *)keys->data;
    float *c = (float *)centroids->data;
    /* All m sub-spaces in one device-resident K-means. KVD_CUDA_KMEANS_EXACT=1
     * selects the host-driven path instead: one K-means per sub-space with
     * the CPU's seeds (km->seed + j) and draws, slower, for comparisons. */
    if (!kvd__cuda_kmeans_exact()) {
        kvd_kmeans_params p = *km;
        p.k = ksub;
        return kvd__cuda_kmeans_train_multi(&call, &p, m, n, dsub, x, D, c, NULL, err);
    }
    for (int j = 0; j < m && !rc; j++) {
        kvd_kmeans_params p = *km;
        p.k = ksub;
        p.seed = km->seed + (uint64_t)j;
        rc = kvd__cuda_kmeans_train(&call, &p, n, dsub, x + (long long)j * dsub, D,
                                    c + (long long)j * ksub * dsub, NULL, err);
    }
    return rc;
}

} /* namespace */

const struct kvd_pq_ops kvd__cuda_pq_ops = {
    cuda_train,
    cuda_encode,
    cuda_search,
    cuda_search_batch,
};
