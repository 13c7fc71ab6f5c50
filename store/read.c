/*
 * Read: a cursor that reassembles the wire layout from pages.
 *
 * read_begin copies, under st->lock, the ids of the pages covering the range
 * and takes a RocksDB snapshot, so the cursor needs no lock afterwards and
 * later appends or deletes do not change what it returns.
 *
 * The output is cut into segments in wire order: part (K, then V) x layer x
 * page. A segment is the rows [t0, t1) of one layer that lie in one page,
 * (t1 - t0) x num_kv_heads x head_dim elements, transposed from the page
 * layout [kv_head][token][head_dim] to the wire layout [token][kv_head][head_dim].
 * Each segment fetches its page (with the tail fragments it needs, see
 * tail.c) and verifies every checksum before any of its bytes are produced. A segment goes straight
 * into the caller's buffer when it fits, else through a staging buffer.
 */
#include "store_internal.h"
#include "seqcodec.h"

#include <stdlib.h>
#include <string.h>

struct kvd_read {
    kvd_store *st;
    const rocksdb_snapshot_t *snap;
    rocksdb_readoptions_t *ropt;
    uint32_t ls, nl, H, D, B;
    size_t es;
    kvd_dtype dtype;
    uint64_t ts, n;
    uint64_t first_block;
    uint32_t npr;       /* pages per layer covering the range */
    uint64_t *page_ids; /* [layer - ls][page - first_block] */
    uint64_t seg, nsegs;
    uint8_t *stage;
    size_t stage_len, stage_off;
    int failed;
    kvd_error saved;
    /* Activation-first reads: X of the first tokens of the range comes
     * first (activation.c); ts and n above are then the K/V tokens after
     * them, full_ts and full_n the whole range. */
    kvd__act_cursor *act;
    uint64_t full_ts, full_n;
    uint32_t hidden;
    /* The sequence's codecs, with its VQ/SVD artifact snapshot (codecs.arts,
     * NULL when it needs none). */
    kvd_seq_codecs codecs;
    int stores_act; /* the sequence was created with store_activations */
};

void kvd_store_read_end(kvd_read *rd)
{
    if (!rd)
        return;
    if (rd->ropt)
        rocksdb_readoptions_destroy(rd->ropt);
    if (rd->snap)
        rocksdb_release_snapshot(rd->st->db, rd->snap);
    free(rd->page_ids);
    free(rd->stage);
    kvd__act_cursor_close(rd->act);
    kvd_seq_codecs_clear(&rd->codecs);
    free(rd);
}

int kvd_store_read_begin(kvd_store *st, const kvd_read_spec *spec, kvd_read **out,
                         kvd_read_shape *shape, kvd_error *err)
{
    if (out)
        *out = NULL;
    if (shape)
        memset(shape, 0, sizeof *shape);
    if (!st || !spec || !out)
        return kvd_error_set(err, KVD_EINVAL, "read: NULL argument");
    int rc = kvd__check_seq_id(spec->seq_id, spec->seq_id_len, err);
    if (rc)
        return rc;
    kvd_read *rd = calloc(1, sizeof *rd);
    if (!rd)
        return kvd_error_set(err, KVD_ENOMEM, "out of memory");
    rd->st = st;
    rd->B = st->page_tokens;

    pthread_rwlock_rdlock(&st->lock);
    kvd__seq *s = kvd__seq_find(st, spec->seq_id, spec->seq_id_len, NULL);
    if (!s) {
        char idb[KVD__ID_STR_MAX];
        rc = kvd_error_set(err, KVD_ENOTFOUND, "sequence %s not found",
                           kvd__id_str(spec->seq_id, spec->seq_id_len, idb, sizeof idb));
        goto fail;
    }
    rd->stores_act = s->act_tokens != NULL;
    const kvd_model_info *mi = &s->model->info;
    if (spec->layer_start >= mi->num_layers) {
        rc = kvd_error_set(err, KVD_EINVAL, "layer_start %u out of the model's %u layers",
                           spec->layer_start, mi->num_layers);
        goto fail;
    }
    rd->ls = spec->layer_start;
    rd->nl = spec->num_layers ? spec->num_layers : mi->num_layers - spec->layer_start;
    if (rd->nl > mi->num_layers - rd->ls) {
        rc = kvd_error_set(err, KVD_EINVAL, "layers %u..%u exceed the model's %u layers", rd->ls,
                           rd->ls + rd->nl - 1, mi->num_layers);
        goto fail;
    }
    /* Tokens readable on every requested layer. */
    uint64_t avail = UINT64_MAX;
    for (uint32_t l = rd->ls; l < rd->ls + rd->nl; l++)
        if (s->layers[l].tokens < avail)
            avail = s->layers[l].tokens;
    if (spec->token_start > avail) {
        rc = kvd_error_set(err, KVD_ERANGE, "token_start %llu is past the %llu tokens stored",
                           (unsigned long long)spec->token_start, (unsigned long long)avail);
        goto fail;
    }
    rd->ts = spec->token_start;
    rd->n = spec->num_tokens ? spec->num_tokens : avail - rd->ts;
    if (rd->n > avail - rd->ts) {
        rc = kvd_error_set(err, KVD_ERANGE,
                           "tokens %llu..%llu are past the %llu tokens stored on layers %u..%u",
                           (unsigned long long)rd->ts, (unsigned long long)(rd->ts + rd->n - 1),
                           (unsigned long long)avail, rd->ls, rd->ls + rd->nl - 1);
        goto fail;
    }
    rd->H = mi->num_kv_heads;
    rd->D = mi->head_dim;
    rd->dtype = mi->dtype;
    rd->es = kvd_dtype_size(mi->dtype);
    rd->full_ts = rd->ts;
    rd->full_n = rd->n;
    if (spec->activation_tokens) {
        if (spec->activation_tokens > rd->n) {
            rc = kvd_error_set(err, KVD_EINVAL,
                               "activation_tokens %llu exceed the %llu tokens read",
                               (unsigned long long)spec->activation_tokens,
                               (unsigned long long)rd->n);
            goto fail;
        }
        if ((rc = kvd__act_cursor_open(st, s, rd->ls, rd->nl, rd->ts, spec->activation_tokens,
                                       &rd->act, err)))
            goto fail;
        rd->hidden = mi->hidden_size;
        rd->ts += spec->activation_tokens;
        rd->n -= spec->activation_tokens;
    }
    if (rd->n) {
        rd->first_block = rd->ts / rd->B;
        rd->npr = (uint32_t)((rd->ts + rd->n - 1) / rd->B - rd->first_block + 1);
        rd->page_ids = malloc((size_t)rd->nl * rd->npr * sizeof *rd->page_ids);
        if (!rd->page_ids) {
            rc = kvd_error_set(err, KVD_ENOMEM, "out of memory");
            goto fail;
        }
        for (uint32_t l = 0; l < rd->nl; l++)
            for (uint32_t j = 0; j < rd->npr; j++)
                rd->page_ids[(size_t)l * rd->npr + j] =
                    s->layers[rd->ls + l].pages[rd->first_block + j]->id;
        rd->nsegs = 2ull * rd->nl * rd->npr;
    }
    atomic_store(&s->last_access_ms, kvd__now_ms());
    rd->ropt = rocksdb_readoptions_create();
    rd->snap = rocksdb_create_snapshot(st->db);
    rocksdb_readoptions_set_snapshot(rd->ropt, rd->snap);
    /* Pages are read once per cursor: keep them out of the block cache. */
    rocksdb_readoptions_set_fill_cache(rd->ropt, 0);
    /* Every page carries its own xxh3 checksum, verified below; RocksDB's
     * per-block CRC on the same bytes would only double the cost. */
    rocksdb_readoptions_set_verify_checksums(rd->ropt, 0);
    pthread_rwlock_unlock(&st->lock);
    /* VQ/SVD pages decode with the snapshot taken at CreateSequence. */
    int found = 0;
    if ((rc = kvd_store_seq_codecs_get(st, spec->seq_id, spec->seq_id_len, &rd->codecs, &found,
                                       err)) ||
        (found && (rc = kvd_seq_codecs_load_arts(st, spec->seq_id, spec->seq_id_len,
                                                 &rd->codecs, err)))) {
        kvd_store_read_end(rd);
        return rc;
    }

    if (shape) {
        shape->layer_start = rd->ls;
        shape->num_layers = rd->nl;
        shape->token_start = rd->full_ts;
        shape->num_tokens = rd->full_n;
        shape->num_kv_heads = rd->H;
        shape->head_dim = rd->D;
        shape->dtype = rd->dtype;
        shape->total_bytes = 2ull * rd->nl * rd->n * rd->H * rd->D * rd->es;
        shape->codecs = &rd->codecs;
        shape->stores_activations = rd->stores_act;
        if (rd->act) {
            shape->activation_tokens = rd->full_n - rd->n;
            shape->hidden_size = rd->hidden;
            shape->activation_bytes = kvd__act_cursor_bytes(rd->act);
        }
    }
    *out = rd;
    return 0;
fail:
    pthread_rwlock_unlock(&st->lock);
    kvd_store_read_end(rd);
    return rc;
}

/* Token range of segment `seg` and its size in bytes. */
static void seg_range(const kvd_read *rd, uint64_t seg, int *part, uint32_t *l, uint32_t *j,
                      uint64_t *t0, uint64_t *t1)
{
    uint64_t per_part = (uint64_t)rd->nl * rd->npr;
    *part = (int)(seg / per_part);
    uint64_t r = seg % per_part;
    *l = (uint32_t)(r / rd->npr);
    *j = (uint32_t)(r % rd->npr);
    uint64_t p0 = (rd->first_block + *j) * rd->B;
    *t0 = p0 > rd->ts ? p0 : rd->ts;
    uint64_t end = rd->ts + rd->n;
    *t1 = p0 + rd->B < end ? p0 + rd->B : end;
}

static size_t seg_bytes(const kvd_read *rd, uint64_t seg)
{
    int part;
    uint32_t l, j;
    uint64_t t0, t1;
    seg_range(rd, seg, &part, &l, &j, &t0, &t1);
    return (size_t)(t1 - t0) * rd->H * rd->D * rd->es;
}

/* Ask the background thread to load the pages of the next segments of the
 * K pass (the V pass reads the same pages again, from memory). */
static void readahead(kvd_read *rd, uint64_t seg)
{
    uint64_t per_part = (uint64_t)rd->nl * rd->npr;
    for (uint32_t k = 1; k <= rd->st->prefetch_pages; k++) {
        uint64_t s2 = seg + k;
        if (s2 >= per_part)
            return;
        int part;
        uint32_t l, j;
        uint64_t t0, t1;
        seg_range(rd, s2, &part, &l, &j, &t0, &t1);
        uint64_t p0 = (rd->first_block + j) * rd->B;
        kvd__prefetch_item it = {.page_id = rd->page_ids[(size_t)l * rd->npr + j],
                                 .layer = rd->ls + l,
                                 .need = (uint32_t)(t1 - p0),
                                 .B = rd->B,
                                 .H = rd->H,
                                 .D = rd->D,
                                 .p0 = p0,
                                 .dtype = rd->dtype};
        kvd__cache_prefetch(rd->st, &it);
    }
}

/* Produce segment `seg` into dst (seg_bytes(rd, seg) bytes). */
static int produce(kvd_read *rd, uint64_t seg, uint8_t *dst, kvd_error *err)
{
    int part;
    uint32_t l, j;
    uint64_t t0, t1;
    seg_range(rd, seg, &part, &l, &j, &t0, &t1);
    uint64_t pid = rd->page_ids[(size_t)l * rd->npr + j];
    uint32_t layer = rd->ls + l;
    uint64_t p0 = (rd->first_block + j) * rd->B;

    kvd__tail_want w = {.page_id = pid,
                        .layer = layer,
                        .p0 = p0,
                        .need = (uint32_t)(t1 - p0),
                        .B = rd->B,
                        .H = rd->H,
                        .D = rd->D,
                        .dtype = rd->dtype,
                        .snap = rd->snap};
    if (part == 0)
        readahead(rd, seg);
    /* A memory tier first: its bytes were verified on their way in. */
    const uint8_t *bytes;
    uint8_t *tmp;
    kvd__centry *e = kvd__cache_acquire(rd->st, pid, w.need, &bytes, &tmp);
    kvd_page_view view;
    const uint8_t *src;
    size_t pn;
    kvd__tail pg = {0};
    int rc;
    if (e) {
        if ((rc = kvd_page_decode_trusted(bytes, e->len, &view, err))) {
            kvd__cache_release(rd->st, e);
            free(tmp);
            return rc;
        }
        src = part ? view.v : view.k;
        pn = view.h.num_tokens;
    } else {
        if ((rc = kvd__tail_load(rd->st, rd->ropt, &w, &pg, err))) {
            if (rc == KVD_ECORRUPT)
                kvd__note_corrupt(rd->st, pid, err);
            return rc;
        }
        if (pg.nfrags == 0) {
            /* Promote the whole page, as stored and just verified. A page
             * deleted since the snapshot may land here too: its id is never
             * reused, so it only waits for the LRU to move it out. */
            size_t len;
            const char *v = rocksdb_pinnableslice_value(pg.ps, &len);
            kvd__centry *in = kvd__cache_insert(rd->st, pid, (const uint8_t *)v, len,
                                                pg.num_tokens, 1);
            if (in) {
                atomic_fetch_add(&rd->st->tiers.promotions, 1);
                kvd__cache_release(rd->st, in);
            }
        }
        src = part ? pg.v : pg.k;
        pn = pg.num_tokens;
        view.h.k_codec = view.h.v_codec = KVD_CODEC_RAW;
        if (pg.nfrags == 0) {
            size_t vlen;
            const char *v = rocksdb_pinnableslice_value(pg.ps, &vlen);
            if ((rc = kvd_page_decode_trusted(v, vlen, &view, err))) {
                kvd__tail_release(&pg);
                return rc;
            }
        }
    }
    size_t row = (size_t)rd->D * rd->es;
    /* A coded (sealed) page is decoded to the model dtype first. */
    uint8_t *dec = NULL;
    if ((part ? view.h.v_codec : view.h.k_codec) != KVD_CODEC_RAW) {
        dec = malloc((size_t)rd->H * pn * row);
        rc = dec ? kvd_page_decode_section(kvd_store_coding_backend(rd->st), &view,
                                           part ? KVD_SECTION_V : KVD_SECTION_K, rd->codecs.arts,
                                           rd->dtype, dec, err)
                 : kvd_error_set(err, KVD_ENOMEM, "out of memory decoding a page");
        if (rc) {
            free(dec);
            if (e)
                kvd__cache_release(rd->st, e);
            free(tmp);
            kvd__tail_release(&pg);
            return rc;
        }
        src = dec;
    }
    for (uint64_t t = t0; t < t1; t++)
        for (uint32_t h = 0; h < rd->H; h++) {
            memcpy(dst, src + ((size_t)h * pn + (size_t)(t - p0)) * row, row);
            dst += row;
        }
    free(dec);
    if (e)
        kvd__cache_release(rd->st, e);
    free(tmp);
    kvd__tail_release(&pg);
    return 0;
}

int kvd_store_read_next(kvd_read *rd, void *buf, size_t cap, size_t *len, kvd_error *err)
{
    if (len)
        *len = 0;
    if (!rd || !len || (cap && !buf))
        return kvd_error_set(err, KVD_EINVAL, "read next: NULL argument");
    if (rd->failed) {
        if (err)
            *err = rd->saved;
        return rd->saved.code;
    }
    uint8_t *out = buf;
    size_t done = 0;
    if (rd->act) {
        /* X first; it ends before cap only when it is all out. */
        int rc = kvd__act_cursor_read(rd->act, out, cap, &done, &rd->saved);
        if (rc) {
            rd->saved.code = rc;
            rd->failed = 1;
            if (err)
                *err = rd->saved;
            return rc;
        }
    }
    while (done < cap) {
        if (rd->stage_off < rd->stage_len) {
            size_t k = rd->stage_len - rd->stage_off;
            if (k > cap - done)
                k = cap - done;
            memcpy(out + done, rd->stage + rd->stage_off, k);
            rd->stage_off += k;
            done += k;
            continue;
        }
        if (rd->seg == rd->nsegs)
            break;
        size_t sb = seg_bytes(rd, rd->seg);
        uint8_t *dst;
        if (sb <= cap - done) {
            dst = out + done;
        } else {
            if (!rd->stage) {
                /* Largest segment: one full page of one part. */
                rd->stage = malloc((size_t)rd->B * rd->H * rd->D * rd->es);
                if (!rd->stage)
                    return kvd_error_set(err, KVD_ENOMEM, "out of memory");
            }
            dst = rd->stage;
        }
        int rc = produce(rd, rd->seg, dst, &rd->saved);
        if (rc) {
            rd->saved.code = rc;
            rd->failed = 1;
            if (err)
                *err = rd->saved;
            return rc;
        }
        rd->seg++;
        if (dst == rd->stage) {
            rd->stage_len = sb;
            rd->stage_off = 0;
        } else {
            done += sb;
        }
    }
    *len = done;
    return 0;
}
