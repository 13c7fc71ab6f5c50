/*
 * Search and SparseAttend: top-k token search over a sequence's PQ index and
 * sparse attention over the tokens it picks (compute.h; kvdepot.proto,
 * SearchRequest, for which centroids and codes).
 */
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "compute_internal.h"
#include "kvdepot/attention.h"
#include "kvdepot/convert.h"
#include "kvdepot/pq.h"
#include "page.h"
#include "pqindex.h"
#include "seqcodec.h"

#define SEARCH_MAX_TOKENS (1u << 20)
/* Tokens read back per step where keys are encoded at call time (32 MiB of
 * K+V at 8 kv heads x 128 dims x f16); at least KVD_PQ_TRAIN_TOKENS. */
#define ENCODE_WINDOW 8192
/* Sealed pages whose codes a search gathers per batch of acquires (their
 * moves between tiers go as one batch of copies). */
#define GATHER_WINDOW 64

/* State of one search, kept for SparseAttend's attention step. */
typedef struct search_run {
    kvd__cseq sc;
    kvd_seq_codecs codecs;
    uint64_t start, n; /* token range */
    uint8_t *kv;       /* SparseAttend: K then V of the selected tokens, (Hkv, per_head,
                        * head_dim) each, model dtype */
    int64_t per_head;  /* entries per kv head */
    int32_t *idx;      /* (Hkv, per_head) positions within the range */
    float *scores;     /* (Hkv, per_head) */
    /* SparseAttend on a device (sparse_device): where each row of kv
     * comes from, K rows then V rows in kv's order: a raw page in the
     * device tier, or the copy of kv at `up` in device memory. */
    uint64_t *addr;
    const uint8_t *up;
    size_t n_up; /* rows of kv read on the host */
    /* SparseAttend on the host: where each row lies, K rows then V rows in
     * kv's order: in a raw page held in a tier, or in kv. */
    const void **rows;
} search_run;

static void search_run_free(search_run *r)
{
    kvd_seq_codecs_clear(&r->codecs);
    free(r->addr);
    free(r->rows);
    free(r->kv);
    free(r->idx);
    free(r->scores);
}

/* What run_search assembles: the codes of the range under one set of
 * centroids. */
typedef struct search_index {
    int H, D, M, nb;
    float *cent;    /* (H, M, 2^nb, D/M) f32 */
    int trained;    /* cent trained at call time (the layer has none stored) */
    uint8_t *codes; /* (H, n, M) */
} search_index;

/* Pages held pinned until a search is done, with their blocks: those whose
 * PQ codes lie in the device tier (a device search: copied into the
 * device's index of the range), or in a host tier (a host search's fills). */
typedef struct dev_codes {
    kvd_page_handle *hs;
    uint64_t *blk;
    size_t n, cap;
} dev_codes;

static void dev_codes_release(kvd_store *st, dev_codes *dc)
{
    for (size_t i = 0; i < dc->n; i++)
        kvd_store_page_release(st, &dc->hs[i]);
    free(dc->hs);
    free(dc->blk);
    memset(dc, 0, sizeof *dc);
}

/* Keep h (pinned); 0 or KVD_ENOMEM. */
static int dev_codes_add(dev_codes *dc, const kvd_page_handle *h, uint64_t blk, kvd_error *err)
{
    if (dc->n == dc->cap) {
        size_t cap = dc->cap ? 2 * dc->cap : 64;
        kvd_page_handle *hs = realloc(dc->hs, cap * sizeof *hs);
        if (hs)
            dc->hs = hs;
        uint64_t *b = realloc(dc->blk, cap * sizeof *b);
        if (b)
            dc->blk = b;
        if (!hs || !b)
            return kvd_error_set(err, KVD_ENOMEM, "out of memory");
        dc->cap = cap;
    }
    dc->hs[dc->n] = *h;
    dc->blk[dc->n++] = blk;
    return 0;
}

/* Codes a search on the host copies kv head by kv head on the thread that
 * searches that head (search_heads' fill): then they are in its caches when
 * its scan reads them. Pieces of pages held in the tiers (pinned until the
 * search is done; a page read from below the tiers is copied at once and
 * let go, so the call holds no more than the tiers' own memory) and of the
 * layer's early codes record: at most one a page of the range, room for
 * which is made up front. */
typedef struct code_piece {
    const uint8_t *src; /* kv head 0's codes of the piece */
    size_t hstride;     /* from one kv head's codes to the next's */
    size_t dst;         /* where the piece goes in a head's codes of the range */
    size_t len;         /* bytes */
} code_piece;

typedef struct code_plan {
    code_piece *pieces;
    size_t n;
    dev_codes held; /* the pages the pieces lie in */
} code_plan;

static void plan_release(kvd_store *st, code_plan *pl)
{
    dev_codes_release(st, &pl->held);
    free(pl->pieces);
    memset(pl, 0, sizeof *pl);
}

/* Kv head h's part of piece c into that head's codes of the range. */
static void piece_copy(uint8_t *head_codes, const code_piece *c, size_t h)
{
    memcpy(head_codes + c->dst, c->src + h * c->hstride, c->len);
}

/* One kv head's pieces into its codes of the range (a search job's fill). */
typedef struct head_fill {
    const code_plan *plan;
    uint8_t *codes;
    size_t h;
} head_fill;

static int fill_head(void *arg)
{
    const head_fill *f = arg;
    for (size_t i = 0; i < f->plan->n; i++)
        piece_copy(f->codes, &f->plan->pieces[i], f->h);
    return 0;
}

/*
 * Codes of tokens [a, b) of the search range (relative to r->start) from
 * their keys read back, ENCODE_WINDOW tokens at a time. Without stored
 * centroids (ix->trained) the first window, which starts the range, trains
 * them first.
 */
static int encode_tokens(const kvd_compute *c, const kvd_search_args *sa, const search_run *r,
                         search_index *ix, uint64_t a, uint64_t b, kvd_error *err)
{
    const kvd_model_info *m = &r->sc.model;
    const int H = ix->H, D = ix->D, M = ix->M;
    const size_t es = kvd_dtype_size(m->dtype);
    const size_t per_head = (size_t)M * ((size_t)1 << ix->nb) * (size_t)(D / M);
    uint64_t win = b - a < ENCODE_WINDOW ? b - a : ENCODE_WINDOW;
    uint8_t *buf = malloc(2 * win * (size_t)H * D * es);
    float *keys = malloc(sizeof(float) * win * D);
    int rc = 0;
    if (!buf || !keys) {
        rc = kvd_error_set(err, KVD_ENOMEM, "out of memory encoding %llu keys",
                           (unsigned long long)win);
        goto done;
    }
    for (uint64_t t0 = a; t0 < b && rc == 0; t0 += win) {
        uint64_t T = b - t0 < win ? b - t0 : win;
        if ((rc = kvd__read_window(c->store, sa->id, sa->id_len, sa->layer, r->start + t0, T, buf,
                                   2 * T * (uint64_t)H * D * es, err)))
            break;
        for (int h = 0; h < H && rc == 0; h++) {
            /* Keys of head h: rows of the wire layout [token][kv_head][dim]. */
            int64_t ks[2] = {(int64_t)T, D}, cs[3] = {M, (int64_t)1 << ix->nb, D / M},
                    ds[2] = {(int64_t)T, M};
            kvd_tensor src = kvd_tensor_make(m->dtype, buf + (size_t)h * D * es, 2, ks);
            src.stride[0] = (int64_t)H * D * (int64_t)es;
            kvd_tensor dst = kvd_tensor_make(KVD_DTYPE_F32, keys, 2, ks);
            if ((rc = kvd_convert(c->be, &dst, &src, err)))
                break;
            float *ch = ix->cent + (size_t)h * per_head;
            if (ix->trained && t0 == 0 &&
                (rc = kvd_pq_train_head(c->be, keys, (int64_t)T, (uint32_t)D, (uint32_t)M,
                                        (uint32_t)ix->nb, r->codecs.pq_iterations, sa->layer,
                                        (uint32_t)h, ch, err)))
                break;
            kvd_tensor tc = kvd_tensor_make(KVD_DTYPE_F32, ch, 3, cs);
            kvd_tensor td = kvd_tensor_make(KVD_DTYPE_U8,
                                            ix->codes + ((size_t)h * r->n + t0) * (size_t)M, 2, ds);
            rc = kvd_pq_encode(c->be, &dst, &tc, &td, err);
        }
    }
done:
    free(buf);
    free(keys);
    return rc;
}

/*
 * Gather the codes of the range: from the PQ section of every sealed page
 * (acquired through the memory tiers) whose centroids are the layer's stored
 * ones; every other token (the raw tail, pages without a section or with
 * another sequence's centroids) is encoded from its keys at call time.
 * With dc (a device search), pages whose codes lie in the device tier are
 * left to dc, pinned, and their rows of ix->codes are not written.
 */
static int gather_codes(const kvd_compute *c, const kvd_search_args *sa, const search_run *r,
                        search_index *ix, uint64_t centroids_id, const kvd_pq_codes *early,
                        dev_codes *dc, code_plan *plan, kvd_error *err)
{
    kvd_store *st = c->store;
    const uint64_t B = kvd_store_page_tokens(st), end = r->start + r->n;
    const uint64_t sealed = r->sc.layer_tokens / B;
    const int H = ix->H, M = ix->M;
    uint64_t todo = r->start; /* tokens [todo, t0) still need encoding */
    int rc = 0;
    const uint64_t last = (end + B - 1) / B < sealed ? (end + B - 1) / B : sealed;
    kvd_page_handle hs[GATHER_WINDOW];
    for (uint64_t w0 = r->start / B; !ix->trained && w0 < last; w0 += GATHER_WINDOW) {
        const size_t nw = (size_t)(last - w0 < GATHER_WINDOW ? last - w0 : GATHER_WINDOW);
        if ((rc = kvd_store_pages_acquire_device(st, sa->id, sa->id_len, sa->layer, w0, nw,
                                                 dc ? KVD_ON_DEVICE_PQ : 0, hs, err)))
            return rc;
        size_t i = 0;
        for (; i < nw && rc == 0; i++) {
            const uint64_t blk = w0 + i;
            uint64_t t0 = blk * B > r->start ? blk * B : r->start;
            uint64_t t1 = blk * B + B < end ? blk * B + B : end;
            kvd_page_handle *ph = &hs[i];
            kvd_page_view v;
            kvd_page_pq pq;
            const kvd_page_layout *l = ph->layout;
            if (l && l->pq_m == (uint32_t)M && l->pq_bits == (uint32_t)ix->nb &&
                l->pq_centroids_id == centroids_id && l->num_kv_heads == (uint32_t)H &&
                l->num_tokens == B) {
                if ((rc = dev_codes_add(dc, ph, blk, err)))
                    break; /* hs[i] is still this loop's to release */
                /* dc holds the page from here (released with dc) */
                if (todo < t0)
                    rc = encode_tokens(c, sa, r, ix, todo - r->start, t0 - r->start, err);
                todo = t1;
                continue;
            }
            int usable = ph->bytes && kvd_page_decode_trusted(ph->bytes, ph->len, &v, NULL) == 0 &&
                         kvd_page_pq_get(&v, &pq) && pq.centroids_id == centroids_id &&
                         pq.m == (uint32_t)M && pq.bits == (uint32_t)ix->nb &&
                         v.h.num_kv_heads == (uint32_t)H && v.h.num_tokens == B;
            int held = 0, later = 0; /* later: copied by the search (fill_head) */
            /* section (kv_head, token, m) -> index (kv_head, range token, m) */
            code_piece pc = {usable ? pq.codes + (size_t)(t0 - blk * B) * M : NULL, (size_t)B * M,
                             (size_t)(t0 - r->start) * M, (size_t)(t1 - t0) * M};
            if (usable && plan && kvd_store_page_in_tier(ph)) {
                if ((rc = dev_codes_add(&plan->held, ph, blk, err)))
                    break; /* hs[i] is still this loop's to release */
                held = later = 1;
            } else if (!usable && early && early->centroids_id == centroids_id &&
                       blk * B >= early->token_start &&
                       blk * B + B <= early->token_start + early->num_tokens) {
                /* a page sealed before the layer was trained: the codes record */
                usable = 1;
                later = plan != NULL;
                pc.src = early->codes + (size_t)(t0 - early->token_start) * M;
                pc.hstride = (size_t)early->num_tokens * M;
            }
            if (later)
                plan->pieces[plan->n++] = pc;
            else if (usable)
                for (int h = 0; h < H; h++)
                    piece_copy(ix->codes + (size_t)h * r->n * M, &pc, (size_t)h);
            if (!held)
                kvd_store_page_release(st, ph);
            if (!usable)
                continue;
            if (todo < t0)
                rc = encode_tokens(c, sa, r, ix, todo - r->start, t0 - r->start, err);
            todo = t1;
        }
        for (; i < nw; i++) /* left by an error */
            kvd_store_page_release(st, &hs[i]);
        if (rc)
            return rc;
    }
    if (todo < end)
        rc = encode_tokens(c, sa, r, ix, todo - r->start, r->n, err);
    return rc;
}

/*
 * The per-head searches of one range as one batch on be (the host's CPU
 * backend, or the device with every pointer in its memory): head h ranks
 * codes + h n M with centroids cent + h per-head and the summed queries of
 * its group, its top entries into idx and sc + h cap. Every head must return
 * r->per_head of them.
 */
static int search_heads(kvd_backend *be, const search_index *ix, const search_run *r,
                        const kvd_pq_search_params *sp, const float *cent, uint8_t *codes,
                        const code_plan *plan, const float *q, uint32_t *idx, float *sc,
                        kvd_error *err)
{
    const size_t H = (size_t)ix->H, M = (size_t)ix->M, K = (size_t)1 << ix->nb;
    const size_t D = (size_t)ix->D, G = r->sc.model.num_q_heads / H, n = r->n;
    const size_t cap = (size_t)(r->per_head ? r->per_head : 1), pc = M * K * (D / M);
    kvd_pq_search_job *jobs = calloc(H, sizeof *jobs);
    kvd_tensor *t = calloc(5 * H, sizeof *t);
    head_fill *hf = plan && plan->n ? calloc(H, sizeof *hf) : NULL;
    int rc = 0;
    if (!jobs || !t || (plan && plan->n && !hf))
        rc = kvd_error_set(err, KVD_ENOMEM, "out of memory");
    for (size_t h = 0; h < H && rc == 0; h++) {
        int64_t cs[3] = {(int64_t)M, (int64_t)K, (int64_t)(D / M)},
                ds[2] = {(int64_t)n, (int64_t)M};
        int64_t qs[2] = {(int64_t)G, (int64_t)D}, os[1] = {r->per_head};
        kvd_tensor *th = t + 5 * h;
        th[0] = kvd_tensor_make(KVD_DTYPE_F32, (void *)(cent + h * pc), 3, cs);
        th[1] = kvd_tensor_make(KVD_DTYPE_U8, (void *)(codes + h * n * M), 2, ds);
        th[2] = kvd_tensor_make(KVD_DTYPE_F32, (void *)(q + h * G * D), 2, qs);
        th[3] = kvd_tensor_make(KVD_DTYPE_U32, idx + h * cap, 1, os);
        th[4] = kvd_tensor_make(KVD_DTYPE_F32, sc + h * cap, 1, os);
        jobs[h] = (kvd_pq_search_job){&th[0], &th[1], &th[2], &th[3], &th[4], 0, NULL, NULL};
        if (hf) {
            hf[h] = (head_fill){plan, codes + h * n * M, h};
            jobs[h].fill = fill_head;
            jobs[h].fill_arg = &hf[h];
        }
    }
    if (rc == 0)
        rc = kvd_pq_search_batch(be, jobs, (int64_t)H, sp, err);
    for (size_t h = 0; h < H && rc == 0; h++)
        if (jobs[h].nout != r->per_head)
            rc = kvd_error_set(err, KVD_EINTERNAL, "search returned %lld of %lld entries",
                               (long long)jobs[h].nout, (long long)r->per_head);
    free(jobs);
    free(t);
    free(hf);
    return rc;
}

static _Atomic uint64_t device_search_pages;

uint64_t kvd_compute_device_search_pages(void)
{
    return atomic_load(&device_search_pages);
}

/*
 * The per-head searches of one range on the device dev, one batch: the
 * centroids, the queries and the codes gathered on the host go up, the
 * codes of the pages in dc are copied within the device from where the
 * pages lie, and only the selected positions and their scores come down.
 */
static int search_device(kvd_backend *dev, const kvd_search_args *sa, search_run *r,
                         const search_index *ix, const kvd_pq_search_params *sp,
                         const dev_codes *dc, uint32_t *uidx, uint64_t B, kvd_error *err)
{
    const size_t H = (size_t)ix->H, M = (size_t)ix->M, K = (size_t)1 << ix->nb;
    const size_t D = (size_t)ix->D, G = r->sc.model.num_q_heads / H, n = r->n;
    const size_t cap = (size_t)(r->per_head ? r->per_head : 1), pc = M * K * (D / M);
    const size_t nf = H * pc + H * G * D + H * cap; /* centroids, queries, scores */
    const size_t bytes = sizeof(float) * nf + sizeof(uint32_t) * H * cap + H * n * M;
    uint8_t *buf = NULL;
    int rc;
    if ((rc = kvd_backend_scratch(dev, bytes, (void **)&buf, err)))
        goto done;
    float *cent = (float *)buf, *q = cent + H * pc, *sc = q + H * G * D;
    uint32_t *idx = (uint32_t *)(sc + H * cap);
    uint8_t *codes = (uint8_t *)(idx + H * cap);
    if ((rc = kvd_backend_upload(dev, cent, ix->cent, sizeof(float) * H * pc, err)) ||
        (rc = kvd_backend_upload(dev, q, sa->q, sizeof(float) * H * G * D, err)) ||
        (rc = kvd_backend_upload(dev, codes, ix->codes, H * n * M, err)))
        goto done;
    for (size_t i = 0; i < dc->n && rc == 0; i++) {
        uint64_t b0 = dc->blk[i] * B, t0 = b0 > r->start ? b0 : r->start;
        uint64_t t1 = b0 + B < r->start + n ? b0 + B : r->start + n;
        const uint8_t *src =
            (const uint8_t *)dc->hs[i].device + dc->hs[i].layout->pq_codes + (t0 - b0) * M;
        rc = kvd_backend_copy2d(dev, codes + (t0 - r->start) * M, n * M, src, B * M, (t1 - t0) * M,
                                H, err);
    }
    if (rc || (rc = search_heads(dev, ix, r, sp, cent, codes, NULL, q, idx, sc, err)))
        goto done;
    if ((rc = kvd_backend_download(dev, uidx, idx, sizeof(uint32_t) * H * cap, err)) ||
        (rc = kvd_backend_download(dev, r->scores, sc, sizeof(float) * H * cap, err)))
        goto done;
    for (size_t i = 0; i < H * (size_t)r->per_head; i++)
        r->idx[i] = (int32_t)uidx[i];
    atomic_fetch_add(&device_search_pages, dc->n);
done:
    kvd_backend_scratch_free(dev, buf);
    return rc;
}

/*
 * Search one token range of one layer: the layer's stored centroids
 * (store/pqindex.h; trained at call time on the first min(n,
 * KVD_PQ_TRAIN_TOKENS) keys of the range when the layer has none yet), the
 * codes of the range (gather_codes), and per kv head the summed queries of
 * its GQA group ranking them (kvd_pq_search).
 */
static int run_search(const kvd_compute *c, kvd_backend *dev, const kvd_search_args *sa,
                      search_run *r, kvd_error *err)
{
    memset(r, 0, sizeof *r);
    int rc;
    if ((rc = kvd__cseq_load(c, sa->id, sa->id_len, "sequence_id", sa->layer, &r->sc, err)))
        return rc;
    const kvd_model_info *m = &r->sc.model;
    int found = 0;
    if ((rc = kvd_store_seq_codecs_get(c->store, sa->id, sa->id_len, &r->codecs, &found, err)))
        return rc;
    if (!r->codecs.pq_m)
        return kvd_error_set(err, KVD_EPRECOND,
                             "sequence has no PQ index (create it with codecs.pq)");
    size_t want = (size_t)m->num_q_heads * m->head_dim;
    if (sa->n_q != want)
        return kvd_error_set(err, KVD_EINVAL,
                             "q: %zu floats, model %s needs num_q_heads x head_dim = %u x %u",
                             sa->n_q, m->name, m->num_q_heads, m->head_dim);
    if ((rc = kvd__query_finite("q", sa->q, sa->n_q, m->head_dim, err)))
        return rc;
    r->start = sa->token_start;
    r->n = sa->num_tokens;
    if ((rc = kvd__token_range("search", r->start, &r->n, r->sc.layer_tokens, err)))
        return rc;
    if (r->n == 0)
        return kvd_error_set(err, KVD_EINVAL, "search: empty token range");
    if (r->n > SEARCH_MAX_TOKENS)
        return kvd_error_set(err, KVD_EINVAL, "search: %llu tokens, at most %u per call",
                             (unsigned long long)r->n, SEARCH_MAX_TOKENS);
    if (sa->k > r->n)
        return kvd_error_set(err, KVD_EINVAL, "k: %u is larger than the %llu tokens searched",
                             sa->k, (unsigned long long)r->n);
    const int H = (int)m->num_kv_heads, D = (int)m->head_dim;
    const int M = (int)r->codecs.pq_m, nb = r->codecs.pq_bits, K = 1 << nb;
    kvd_cpu_task_expect(r->n * (uint64_t)H * (uint64_t)M); /* the codes scanned: the slots' rank */
    kvd_pq_search_params sp = {sa->k, sa->initial_tokens, sa->recent_tokens, KVD_PQ_AGG_SUM};
    r->per_head = kvd_pq_search_count((int64_t)r->n, &sp);
    size_t cap = (size_t)(r->per_head ? r->per_head : 1);
    kvd_pq_centroids pc;
    int stored = 0;
    if ((rc = kvd_store_pq_centroids_get(c->store, sa->id, sa->id_len, sa->layer, &pc, &stored,
                                         err)))
        return rc;
    if (stored && (pc.num_kv_heads != (uint32_t)H || pc.head_dim != (uint32_t)D ||
                   pc.m != (uint32_t)M || pc.bits != (uint32_t)nb)) {
        kvd_pq_centroids_clear(&pc);
        return kvd_error_set(err, KVD_ECORRUPT,
                             "stored PQ centroids of layer %u do not match the sequence's "
                             "model and codecs",
                             sa->layer);
    }
    search_index ix = {H, D, M, nb, stored ? pc.data : NULL, !stored, NULL};
    if (!stored)
        ix.cent = malloc(sizeof(float) * (size_t)H * M * K * (D / M));
    ix.codes = malloc((size_t)H * r->n * (size_t)M);
    r->idx = malloc(sizeof(int32_t) * cap * H);
    r->scores = malloc(sizeof(float) * cap * H);
    uint32_t *uidx = malloc(sizeof(uint32_t) * cap * H);
    dev_codes dc;
    memset(&dc, 0, sizeof dc);
    code_plan plan;
    memset(&plan, 0, sizeof plan);
    kvd_pq_codes early = {0};
    /* a host search's pieces: at most one a page of the range */
    if (!dev)
        plan.pieces =
            malloc(sizeof *plan.pieces * (size_t)(r->n / kvd_store_page_tokens(c->store) + 2));
    if (!ix.cent || !ix.codes || !r->idx || !r->scores || !uidx || (!dev && !plan.pieces)) {
        rc = kvd_error_set(err, KVD_ENOMEM, "out of memory for a %llu-token search",
                           (unsigned long long)r->n);
        goto done;
    }
    int have_early = 0;
    if (stored && (rc = kvd_store_pq_codes_get(c->store, sa->id, sa->id_len, sa->layer, &early,
                                               &have_early, err)))
        goto done;
    if (have_early && (early.num_kv_heads != (uint32_t)H || early.m != (uint32_t)M))
        have_early = 0; /* not of this index: its tokens are encoded at call time */
    /* on the host the codes of pages held in the tiers (and of the early
     * record, kept until then) are copied by each head's search */
    rc = gather_codes(c, sa, r, &ix, stored ? pc.id : 0, have_early ? &early : NULL,
                      dev ? &dc : NULL, dev ? NULL : &plan, err);
    if (rc)
        goto done;
    if (dev) {
        rc = search_device(dev, sa, r, &ix, &sp, &dc, uidx, kvd_store_page_tokens(c->store), err);
        goto done;
    }
    /* one batch: the backend shares the kv heads among its threads */
    if ((rc = search_heads(c->be, &ix, r, &sp, ix.cent, ix.codes, &plan, sa->q, uidx, r->scores,
                           err)))
        goto done;
    for (size_t i = 0; i < (size_t)H * r->per_head; i++)
        r->idx[i] = (int32_t)uidx[i];
done:
    plan_release(c->store, &plan);
    kvd_pq_codes_clear(&early);
    dev_codes_release(c->store, &dc);
    if (stored)
        kvd_pq_centroids_clear(&pc);
    else
        free(ix.cent);
    free(ix.codes);
    free(uidx);
    return rc;
}

/* The selected tokens and their scores into the caller's result. */
static int fill_result(const search_run *r, kvd_search_result *out, kvd_error *err)
{
    const size_t H = r->sc.model.num_kv_heads, P = (size_t)r->per_head;
    out->num_kv_heads = (uint32_t)H;
    out->per_head = P;
    out->tokens = malloc(sizeof(uint64_t) * (P ? P : 1) * H);
    out->scores = malloc(sizeof(float) * (P ? P : 1) * H);
    if (!out->tokens || !out->scores)
        return kvd_error_set(err, KVD_ENOMEM, "out of memory");
    for (size_t i = 0; i < H * P; i++)
        out->tokens[i] = r->start + (uint64_t)r->idx[i];
    if (H > 0 && P > 0)
        memcpy(out->scores, r->scores, sizeof(float) * H * P);
    return 0;
}

void kvd_search_result_clear(kvd_search_result *r)
{
    if (!r)
        return;
    free(r->tokens);
    free(r->scores);
    free(r->out);
    free(r->lse);
    memset(r, 0, sizeof *r);
}

/* run_search on the store's device when it has one, again on the CPU when
 * the device fails (kvd__device_fallback). */
static int run_search_any(const kvd_compute *c, const kvd_search_args *sa, search_run *r,
                          kvd_error *err)
{
    kvd_backend *dev = c->dev ? kvd_store_device(c->store) : NULL;
    int rc = run_search(c, dev, sa, r, err);
    if (kvd__device_fallback(c->store, dev, rc, err)) {
        search_run_free(r);
        rc = run_search(c, NULL, sa, r, err);
    }
    return rc;
}

int kvd_compute_search(const kvd_compute *c, const kvd_search_args *a, kvd_search_result *out,
                       kvd_error *err)
{
    search_run r;
    int rc = run_search_any(c, a, &r, err);
    if (rc == 0)
        rc = fill_result(&r, out, err);
    search_run_free(&r);
    return rc;
}

/* One selected token: position `i` of kv head `h`'s list. */
typedef struct sel_entry {
    uint64_t t; /* absolute token */
    uint32_t h, i;
} sel_entry;

/* *pe grouped by block (t / B), blocks in order, by a counting sort: a
 * selection is thousands of entries over a few hundred blocks, where
 * qsort's comparisons cost more than the copies they order (the order
 * within a block does not matter: every entry has its own destination).
 * b0: the first block of the range, nb its blocks. 0, or -1 out of memory
 * (*pe unchanged). */
static int sort_by_block(sel_entry **pe, size_t n, uint64_t b0, uint64_t nb, uint64_t B)
{
    size_t *at = calloc(nb + 1, sizeof *at);
    sel_entry *out = malloc(sizeof *out * (n ? n : 1)), *e = *pe;
    uint32_t *bi = malloc(sizeof *bi * (n ? n : 1)); /* each entry's block: one division */
    if (!at || !out || !bi || nb > UINT32_MAX) {
        free(at);
        free(out);
        free(bi);
        return -1;
    }
    for (size_t x = 0; x < n; x++)
        at[(bi[x] = (uint32_t)(e[x].t / B - b0)) + 1]++;
    for (uint64_t b = 0; b < nb; b++)
        at[b + 1] += at[b];
    for (size_t x = 0; x < n; x++)
        out[at[bi[x]]++] = e[x];
    free(at);
    free(bi);
    free(e);
    *pe = out;
    return 0;
}

/* Copy the K and V rows of entries [e0, e1) from rows laid out at k / v with
 * `tstride` bytes per token and `hstride` per head, token t0 first, into
 * r->kv. */
static void copy_rows(search_run *r, const sel_entry *e, size_t e0, size_t e1, const uint8_t *k,
                      const uint8_t *v, uint64_t t0, size_t tstride, size_t hstride, size_t row)
{
    const size_t P = (size_t)r->per_head, H = r->sc.model.num_kv_heads;
    uint8_t *kc = r->kv, *vc = r->kv + H * P * row;
    for (size_t x = e0; x < e1; x++) {
        size_t src = (size_t)(e[x].t - t0) * tstride + e[x].h * hstride;
        size_t dst = ((size_t)e[x].h * P + e[x].i) * row;
        if (x + 4 < e1) { /* scattered rows: ask for one a few entries ahead */
            size_t ahead = (size_t)(e[x + 4].t - t0) * tstride + e[x + 4].h * hstride;
            for (size_t o = 0; o < row; o += 64) {
                __builtin_prefetch(k + ahead + o);
                __builtin_prefetch(v + ahead + o);
            }
        }
        memcpy(kc + dst, k + src, row);
        memcpy(vc + dst, v + src, row);
        if (r->addr) { /* goes up with kv */
            r->n_up++;
            r->addr[dst / row] = (uint64_t)(uintptr_t)(r->up + dst);
            r->addr[H * P + dst / row] = (uint64_t)(uintptr_t)(r->up + H * P * row + dst);
        } else if (r->rows) {
            r->rows[dst / row] = kc + dst;
            r->rows[H * P + dst / row] = vc + dst;
        }
    }
}

/* The same rows where they lie in a raw page held on the host (K and V
 * sections k and v, [kv_head][token][dim], B tokens): their addresses into
 * r->rows. */
static void host_rows(const search_run *r, const sel_entry *e, size_t e0, size_t e1,
                      const uint8_t *k, const uint8_t *v, uint64_t t0, uint64_t B, size_t row)
{
    const size_t P = (size_t)r->per_head, H = r->sc.model.num_kv_heads;
    for (size_t x = e0; x < e1; x++) {
        const size_t i = (size_t)e[x].h * P + e[x].i;
        const size_t at = ((size_t)e[x].h * B + (size_t)(e[x].t - t0)) * row;
        r->rows[i] = k + at;
        r->rows[H * P + i] = v + at;
    }
}

/* The same rows where they lie in a raw page of the device tier (its K and
 * V (Hkv, B, D) tensors k and v): their addresses into r->addr. */
static void device_rows(const search_run *r, const sel_entry *e, size_t e0, size_t e1,
                        const kvd_tensor *k, const kvd_tensor *v, uint64_t t0)
{
    const size_t P = (size_t)r->per_head, H = r->sc.model.num_kv_heads;
    for (size_t x = e0; x < e1; x++) {
        const size_t i = (size_t)e[x].h * P + e[x].i, t = (size_t)(e[x].t - t0);
        r->addr[i] = (uint64_t)(uintptr_t)((const uint8_t *)k->data + e[x].h * k->stride[0] +
                                           t * k->stride[1]);
        r->addr[H * P + i] = (uint64_t)(uintptr_t)((const uint8_t *)v->data +
                                                   e[x].h * v->stride[0] + t * v->stride[1]);
    }
}

/*
 * K and V of the tokens Search selected, into r->kv ((Hkv, per_head, D)
 * each, in the order of r->idx). Raw sealed pages are read in place,
 * pinned through the tiers; tokens of coded pages and of the raw tail come
 * through the read cursor, in runs of whole blocks of at most ENCODE_WINDOW
 * tokens. Only blocks holding a selected token are read.
 * With r->addr (sparse_device), raw sealed pages of the device tier are not
 * read: the addresses of their rows go into r->addr, and the pages stay
 * pinned in *held (n_held of them; the caller releases them). With r->rows
 * (on the host), likewise for raw sealed pages in the host's tiers: nothing
 * of them is copied, their rows' addresses go into r->rows (a page the
 * tiers had no room for is copied from and let go, as without r->rows: the
 * call holds no more memory than the tiers' own).
 */
static int gather_selected(const kvd_compute *c, const kvd_search_args *sa, search_run *r,
                           kvd_page_handle *held, size_t *n_held, kvd_error *err)
{
    kvd_store *st = c->store;
    const kvd_model_info *m = &r->sc.model;
    const size_t H = m->num_kv_heads, P = (size_t)r->per_head, n_sel = H * P;
    const size_t row = (size_t)m->head_dim * kvd_dtype_size(m->dtype);
    const uint64_t B = kvd_store_page_tokens(st), sealed = r->sc.layer_tokens / B;
    const uint64_t end = r->start + r->n;
    free(r->kv); /* from a device attempt that failed */
    r->kv = malloc(2 * (n_sel ? n_sel : 1) * row);
    sel_entry *e = malloc(sizeof *e * (n_sel ? n_sel : 1));
    uint8_t *buf = NULL;
    int rc = 0;
    if (!r->kv || !e) {
        rc = kvd_error_set(err, KVD_ENOMEM, "out of memory for %zu selected tokens", n_sel);
        goto done;
    }
    for (size_t h = 0; h < H; h++)
        for (size_t i = 0; i < P; i++)
            e[h * P + i] =
                (sel_entry){r->start + (uint64_t)r->idx[h * P + i], (uint32_t)h, (uint32_t)i};
    if (sort_by_block(&e, n_sel, r->start / B, r->n ? (end - 1) / B - r->start / B + 1 : 0, B)) {
        rc = kvd_error_set(err, KVD_ENOMEM, "out of memory for %zu selected tokens", n_sel);
        goto done;
    }
    uint64_t run_a = 0, run_b = 0; /* pending cursor run [run_a, run_b) ... */
    size_t run_e0 = 0, run_e1 = 0; /* ... and its entries */
    for (size_t x = 0; x <= n_sel && rc == 0;) {
        uint64_t blk = x < n_sel ? e[x].t / B : UINT64_MAX;
        size_t y = x;
        /* the entries are in block order: the block's run ends at its end */
        while (y < n_sel && e[y].t < (blk + 1) * B)
            y++;
        int in_place = 0;
        if (blk < sealed && r->addr) {
            kvd_page_handle ph;
            if ((rc = kvd_store_page_acquire_device(st, sa->id, sa->id_len, sa->layer, blk,
                                                    KVD_ON_DEVICE_ATTEND, &ph, err)))
                break;
            const kvd_page_layout *l = ph.layout;
            if (l && ph.device && l->k_codec == KVD_CODEC_RAW && l->num_tokens == B) {
                kvd_attn_qdata kq, vq;
                kvd_page_layout_at(l, ph.device, &kq, &vq);
                device_rows(r, e, x, y, &kq.codes, &vq.codes, blk * B);
                held[(*n_held)++] = ph;
                in_place = 1;
            } else {
                kvd_store_page_release(st, &ph);
            }
        }
        if (blk < sealed && !in_place) {
            kvd_page_handle ph;
            kvd_page_view v;
            int kept = 0;
            if ((rc = kvd_store_page_acquire(st, sa->id, sa->id_len, sa->layer, blk, &ph, err)))
                break;
            if (kvd_page_decode_trusted(ph.bytes, ph.len, &v, NULL) == 0 &&
                v.h.k_codec == KVD_CODEC_RAW && v.h.v_codec == KVD_CODEC_RAW &&
                v.h.num_tokens == B) {
                /* page layout [kv_head][token][dim] */
                if (r->rows && kvd_store_page_in_tier(&ph)) { /* read in place */
                    host_rows(r, e, x, y, v.k, v.v, blk * B, B, row);
                    held[(*n_held)++] = ph;
                    kept = 1;
                } else {
                    copy_rows(r, e, x, y, v.k, v.v, blk * B, row, (size_t)B * row, row);
                }
                in_place = 1;
            }
            if (!kept)
                kvd_store_page_release(st, &ph);
        }
        uint64_t a = 0, b = 0; /* the block's tokens in the range */
        if (x < n_sel) {
            a = blk * B > r->start ? blk * B : r->start;
            b = blk * B + B < end ? blk * B + B : end;
        }
        int extend =
            !in_place && x < n_sel && run_b == a && run_b > run_a && b - run_a <= ENCODE_WINDOW;
        if (!extend && run_b > run_a) {
            /* flush the pending run: wire layout [token][kv_head][dim] */
            uint64_t T = run_b - run_a, bytes = 2 * T * H * row;
            if (!buf && !(buf = malloc(2 * (size_t)ENCODE_WINDOW * H * row))) {
                rc = kvd_error_set(err, KVD_ENOMEM, "out of memory");
                break;
            }
            if ((rc = kvd__read_window(st, sa->id, sa->id_len, sa->layer, run_a, T, buf, bytes,
                                       err)))
                break;
            copy_rows(r, e, run_e0, run_e1, buf, buf + bytes / 2, run_a, H * row, row, row);
            run_a = run_b = 0;
        }
        if (!in_place && x < n_sel) {
            if (extend)
                run_b = b;
            else {
                run_a = a;
                run_b = b;
                run_e0 = x;
            }
            run_e1 = y;
        }
        if (x == n_sel)
            break;
        x = y;
    }
done:
    free(e);
    free(buf);
    return rc;
}

/* The selected rows on the device (gather_selected with r->addr), the
 * attention over them there: one gather_rows and one sparse attention
 * launch; up go the rows read on the host, the row addresses, the query and
 * the identity index, down the output and LSE. */
static int sparse_device(const kvd_compute *c, kvd_backend *dev, const kvd_search_args *sa,
                         search_run *r, const kvd_attn_dims *dims, float *out, float *lse,
                         kvd_error *err)
{
    const kvd_model_info *m = &r->sc.model;
    const size_t H = m->num_kv_heads, P = (size_t)r->per_head, n_sel = H * P;
    const size_t D = m->head_dim, Hq = m->num_q_heads;
    const size_t row = D * kvd_dtype_size(m->dtype), kv = 2 * n_sel * row;
    const uint64_t B = kvd_store_page_tokens(c->store);
    /* Device memory: the host rows | the gathered rows | addresses | q |
     * identity index | out, lse; each part 256-byte aligned. */
    size_t o[7], total = 0;
    const size_t part[6] = {kv,
                            kv,
                            sizeof(uint64_t) * 2 * n_sel,
                            sizeof(float) * Hq * D,
                            sizeof(int32_t) * n_sel,
                            sizeof(float) * Hq * (D + 1)};
    for (int i = 0; i < 6; i++) {
        o[i] = total;
        total += (part[i] + 255) & ~(size_t)255;
    }
    uint8_t *m_dev = NULL;
    size_t n_held = 0;
    const uint64_t max_pages = r->n / B + 2;
    kvd_page_handle *held =
        malloc(sizeof *held * (size_t)(max_pages < n_sel ? max_pages : n_sel + 1));
    int32_t *seq = malloc(sizeof(int32_t) * (n_sel ? n_sel : 1));
    r->addr = malloc(sizeof(uint64_t) * 2 * (n_sel ? n_sel : 1));
    int rc = 0;
    if (!held || !seq || !r->addr) {
        rc = kvd_error_set(err, KVD_ENOMEM, "out of memory");
        goto done;
    }
    if ((rc = kvd_backend_scratch(dev, total, (void **)&m_dev, err)))
        goto done;
    r->up = m_dev + o[0];
    if ((rc = gather_selected(c, sa, r, held, &n_held, err)))
        goto done;
    for (size_t h = 0; h < H; h++)
        for (size_t i = 0; i < P; i++)
            seq[h * P + i] = (int32_t)i;
    float *d_out = (float *)(void *)(m_dev + o[5]);
    if ((r->n_up && (rc = kvd_backend_upload(dev, m_dev + o[0], r->kv, kv, err))) ||
        (rc = kvd_backend_upload(dev, m_dev + o[2], r->addr, part[2], err)) ||
        (rc = kvd_backend_upload(dev, m_dev + o[3], sa->q, part[3], err)) ||
        (rc = kvd_backend_upload(dev, m_dev + o[4], seq, part[4], err)) ||
        (rc = kvd_gather_rows(dev, m_dev + o[1], (const uint64_t *)(void *)(m_dev + o[2]),
                              (int64_t)(2 * n_sel), row, err)))
        goto done;
    kvd_attn_sparse_args a;
    memset(&a, 0, sizeof a);
    a.dims = *dims;
    int64_t qs[2] = {(int64_t)Hq, (int64_t)D}, ls[1] = {(int64_t)Hq},
            ks[3] = {(int64_t)H, (int64_t)(P ? P : 1), (int64_t)D},
            is[2] = {(int64_t)H, (int64_t)P};
    a.q = kvd_tensor_make(KVD_DTYPE_F32, m_dev + o[3], 2, qs);
    a.k = kvd_tensor_make(m->dtype, m_dev + o[1], 3, ks);
    a.v = a.k;
    a.v.data = m_dev + o[1] + n_sel * row;
    a.idx = kvd_tensor_make(KVD_DTYPE_I32, m_dev + o[4], 2, is);
    a.out = kvd_tensor_make(KVD_DTYPE_F32, d_out, 2, qs);
    a.lse = kvd_tensor_make(KVD_DTYPE_F32, d_out + Hq * D, 1, ls);
    if ((rc = kvd_attn_sparse(dev, 1, &a, err)) ||
        (rc = kvd_backend_download(dev, out, d_out, sizeof(float) * Hq * D, err)) ||
        (rc = kvd_backend_download(dev, lse, d_out + Hq * D, sizeof(float) * Hq, err)))
        goto done;
    kvd__device_pages_add(n_held);
done:
    for (size_t i = 0; i < n_held; i++)
        kvd_store_page_release(c->store, &held[i]);
    kvd_backend_scratch_free(dev, m_dev);
    free(held);
    free(seq);
    free(r->addr);
    r->addr = NULL;
    r->up = NULL;
    r->n_up = 0;
    return rc;
}

int kvd_compute_sparse_attend(const kvd_compute *c, const kvd_search_args *sa, float scale,
                              kvd_search_result *out, kvd_error *err)
{
    if (!isfinite(scale))
        return kvd_error_set(err, KVD_EINVAL, "scale: not finite");
    search_run r;
    int rc;
    if ((rc = run_search_any(c, sa, &r, err)) || (rc = fill_result(&r, out, err))) {
        search_run_free(&r);
        return rc;
    }
    /* the slots' rank: the codes scanned and the f16 K/V rows attended */
    const uint64_t kvh = r.sc.model.num_kv_heads, codes = r.n * kvh * r.codecs.pq_m;
    kvd_cpu_task_expect(codes + (uint64_t)r.per_head * kvh * r.sc.model.head_dim * 4);
    kvd_backend *dev = c->dev ? kvd_store_device(c->store) : NULL;
    if (dev) {
        const kvd_model_info *m = &r.sc.model;
        const int Hq = (int)m->num_q_heads, D = (int)m->head_dim;
        kvd_attn_dims dims = {Hq, (int)m->num_kv_heads, D, D,
                              kvd__default_scale(scale, m->head_dim)};
        out->out = malloc(sizeof(float) * (size_t)Hq * D);
        out->lse = malloc(sizeof(float) * Hq);
        out->num_q_heads = (uint32_t)Hq;
        out->head_dim = (uint32_t)D;
        if (!out->out || !out->lse)
            rc = kvd_error_set(err, KVD_ENOMEM, "out of memory");
        else
            rc = sparse_device(c, dev, sa, &r, &dims, out->out, out->lse, err);
        if (!kvd__device_fallback(c->store, dev, rc, err)) {
            search_run_free(&r);
            return rc;
        }
        free(out->out);
        free(out->lse);
        out->out = out->lse = NULL;
    }
    /* On the host: the selected tokens in Search's order (attention over
     * the same tokens in the same order as over the range with r.idx), read
     * where they lie: raw pages stay held in their tier while attended. */
    const kvd_model_info *m = &r.sc.model;
    const int H = (int)m->num_kv_heads, D = (int)m->head_dim, Hq = (int)m->num_q_heads;
    const size_t n_sel = (size_t)H * (size_t)r.per_head;
    const uint64_t max_pages = r.n / kvd_store_page_tokens(c->store) + 2;
    size_t n_held = 0;
    kvd_page_handle *held =
        malloc(sizeof *held * (size_t)(max_pages < n_sel ? max_pages : n_sel + 1));
    r.rows = malloc(sizeof *r.rows * 2 * (n_sel ? n_sel : 1));
    out->out = malloc(sizeof(float) * (size_t)Hq * D);
    out->lse = malloc(sizeof(float) * Hq);
    out->num_q_heads = (uint32_t)Hq;
    out->head_dim = (uint32_t)D;
    if (!held || !r.rows || !out->out || !out->lse) {
        rc = kvd_error_set(err, KVD_ENOMEM, "out of memory");
        goto done;
    }
    if ((rc = gather_selected(c, sa, &r, held, &n_held, err)))
        goto done;
    const kvd_attn_dims dims = {Hq, H, D, D, kvd__default_scale(scale, m->head_dim)};
    int64_t qs[2] = {Hq, D}, ls[1] = {Hq};
    const kvd_tensor q = kvd_tensor_make(KVD_DTYPE_F32, (void *)sa->q, 2, qs);
    const kvd_tensor o = kvd_tensor_make(KVD_DTYPE_F32, out->out, 2, qs);
    const kvd_tensor l = kvd_tensor_make(KVD_DTYPE_F32, out->lse, 1, ls);
    rc = kvd_cpu_attn_rows(&dims, &q, m->dtype, r.rows, r.rows + n_sel, r.per_head, &o, &l,
                           c->be->nthreads, err);
done:
    for (size_t i = 0; i < n_held; i++)
        kvd_store_page_release(c->store, &held[i]);
    free(held);
    search_run_free(&r);
    return rc;
}

int kvd_compute_pq_centroids(const kvd_compute *c, const void *id, size_t id_len, uint32_t layer,
                             kvd_pq_centroids *out, kvd_error *err)
{
    memset(out, 0, sizeof *out);
    kvd__cseq sc;
    kvd_seq_codecs codecs;
    int rc, found = 0;
    if ((rc = kvd__cseq_load(c, id, id_len, "sequence_id", layer, &sc, err)) ||
        (rc = kvd_store_seq_codecs_get(c->store, id, id_len, &codecs, &found, err)))
        return rc;
    const uint32_t pq_m = codecs.pq_m, min_train = codecs.pq_min_train_tokens;
    kvd_seq_codecs_clear(&codecs);
    if (!pq_m)
        return kvd_error_set(err, KVD_EPRECOND,
                             "sequence has no PQ index (create it with codecs.pq)");
    if ((rc = kvd_store_pq_centroids_get(c->store, id, id_len, layer, out, &found, err)))
        return rc;
    if (!found) {
        const uint32_t B = kvd_store_page_tokens(c->store);
        return kvd_error_set(err, KVD_EPRECOND,
                             "layer %u has no PQ centroids yet: they are trained by the append "
                             "that seals a page (of %u tokens) and leaves the layer with at least "
                             "%u tokens (pq.min_train_tokens); %llu stored",
                             layer, B, min_train > B ? min_train : B,
                             (unsigned long long)sc.layer_tokens);
    }
    return 0;
}

int kvd_compute_pq_rebuild(const kvd_compute *c, const void *id, size_t id_len,
                           uint32_t layer_start, uint32_t num_layers, kvd_pq_rebuild_info *info,
                           kvd_error *err)
{
    memset(info, 0, sizeof *info);
    kvd__cseq sc;
    int rc = kvd__cseq_load(c, id, id_len, "sequence_id", layer_start, &sc, err);
    if (rc)
        return rc;
    kvd_pq_rebuild *rb = NULL;
    uint64_t bound = 0;
    if ((rc = kvd_store_pq_rebuild_begin(c->store, id, id_len, layer_start, num_layers, &rb, &bound,
                                         err)))
        return rc;
    const kvd_compute_guard *g = c->guard;
    const char *model = sc.model.name;
    int reserved = 0;
    if (bound && g && g->reserve) {
        if ((rc = g->reserve(g->arg, model, bound, err))) {
            kvd_store_pq_rebuild_abort(rb);
            return rc;
        }
        reserved = 1;
    }
    if ((rc = kvd_store_pq_rebuild_run(rb, err))) {
        kvd_store_pq_rebuild_abort(rb);
    } else {
        /* The reservation becomes usage as the index is written. */
        if (g && g->commit_lock)
            g->commit_lock(g->arg, 1);
        rc = kvd_store_pq_rebuild_commit(rb, info, err);
        if (rc == 0 && reserved && g->settle)
            g->settle(g->arg, model, bound);
        if (g && g->commit_lock)
            g->commit_lock(g->arg, 0);
    }
    if (rc && reserved && g->release)
        g->release(g->arg, model, bound);
    return rc;
}
