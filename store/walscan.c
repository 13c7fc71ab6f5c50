/*
 * What a point-in-time recovery of a damaged write-ahead log drops, per
 * sequence (store.h, kvd_store_recovery_losses).
 *
 * RocksDB's point-in-time recovery replays the WAL up to the first record
 * that fails its checksum and drops everything after it; the WAL files are
 * then gone. Before that open, the sequence records written by every write
 * batch in the WAL files are read here (best effort: RocksDB's log format,
 * 32 KiB blocks of checksummed fragments; a fragment whose header does not
 * fit its block is skipped to the next block, checksums are not needed).
 * After the open, every batch numbered above the recovered database's
 * latest sequence number was dropped: the last such write of each
 * sequence, compared with what came back, says what the sequence lost.
 *
 * Losses are kept as 'L' records (acknowledged tokens, recovered tokens,
 * time) beside the sequence until it is deleted, and shown by StatSequence.
 */
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "store_internal.h"

#define BLOCK 32768u
#define KEY_LOSS 'L'

/* One write to a sequence record found in the WAL. */
typedef struct wal_write {
    uint64_t seqno; /* of its write batch */
    uint8_t id[KVD_SEQ_ID_MAX];
    size_t id_len;
    int64_t tokens; /* after the write; -1 deleted; -2 record unreadable */
} wal_write;

typedef struct wal_writes {
    wal_write *w;
    size_t n, cap;
} wal_writes;

static uint64_t ld(const uint8_t *p, int n)
{
    uint64_t v = 0;
    for (int i = 0; i < n; i++)
        v |= (uint64_t)p[i] << (8 * i);
    return v;
}

static int varint(const uint8_t **p, const uint8_t *end, uint64_t *out)
{
    uint64_t v = 0;
    for (int shift = 0; shift < 64 && *p < end; shift += 7) {
        uint8_t b = *(*p)++;
        v |= (uint64_t)(b & 0x7f) << shift;
        if (!(b & 0x80)) {
            *out = v;
            return 0;
        }
    }
    return -1;
}

static int varstr(const uint8_t **p, const uint8_t *end, const uint8_t **s, size_t *n)
{
    uint64_t len;
    if (varint(p, end, &len) || len > (uint64_t)(end - *p))
        return -1;
    *s = *p;
    *n = (size_t)len;
    *p += len;
    return 0;
}

static void note(wal_writes *ws, uint64_t seqno, const uint8_t *key, size_t klen, int64_t tokens)
{
    if (klen < 2 || klen - 1 > KVD_SEQ_ID_MAX || key[0] != KVD__KEY_SEQ)
        return;
    if (ws->n == ws->cap) {
        size_t nc = ws->cap ? 2 * ws->cap : 64;
        wal_write *nw = realloc(ws->w, nc * sizeof *nw);
        if (!nw)
            return;
        ws->w = nw;
        ws->cap = nc;
    }
    wal_write *w = &ws->w[ws->n++];
    w->seqno = seqno;
    memcpy(w->id, key + 1, klen - 1);
    w->id_len = klen - 1;
    w->tokens = tokens;
}

/* The writes to sequence records in one write batch (RocksDB's
 * WriteBatch: sequence number, count, then tagged entries). */
static void parse_batch(wal_writes *ws, const uint8_t *p, size_t n)
{
    if (n < 12)
        return;
    const uint64_t seqno = ld(p, 8);
    const uint8_t *q = p + 12, *end = p + n;
    while (q < end) {
        const uint8_t tag = *q++;
        uint64_t cf;
        const uint8_t *k, *v;
        size_t kl, vl;
        switch (tag) {
        case 0x5:  /* column family value */
        case 0x6:  /* column family merge */
        case 0x10: /* column family blob index */
            if (varint(&q, end, &cf))
                return;
            /* fall through */
        case 0x1:  /* value */
        case 0x2:  /* merge */
        case 0x11: /* blob index */
            if (varstr(&q, end, &k, &kl) || varstr(&q, end, &v, &vl))
                return;
            if (tag == 0x1 || tag == 0x5)
                note(ws, seqno, k, kl, kvd__seq_record_tokens(v, vl));
            break;
        case 0x4: /* column family deletion */
        case 0x8: /* column family single deletion */
            if (varint(&q, end, &cf))
                return;
            /* fall through */
        case 0x0: /* deletion */
        case 0x7: /* single deletion */
            if (varstr(&q, end, &k, &kl))
                return;
            note(ws, seqno, k, kl, -1);
            break;
        case 0xE: /* column family range deletion */
            if (varint(&q, end, &cf))
                return;
            /* fall through */
        case 0xF: /* range deletion */
            if (varstr(&q, end, &k, &kl) || varstr(&q, end, &v, &vl))
                return;
            break;
        case 0x3: /* log data */
            if (varstr(&q, end, &k, &kl))
                return;
            break;
        case 0xD: /* no-op */
            break;
        default: /* transactions, wide columns: kvdepot writes none */
            return;
        }
    }
}

/* Every write batch of one WAL file (RocksDB's log format). */
static void scan_file(wal_writes *ws, const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return;
    uint8_t *buf = NULL, *rec = NULL;
    size_t size = 0, cap = 0, rlen = 0;
    if (fseek(f, 0, SEEK_END) == 0) {
        long s = ftell(f);
        if (s > 0 && (buf = malloc((size_t)s)) && fseek(f, 0, SEEK_SET) == 0 &&
            fread(buf, 1, (size_t)s, f) == (size_t)s)
            size = (size_t)s;
    }
    fclose(f);
    int in_record = 0;
    for (size_t pos = 0; pos + 7 <= size;) {
        const size_t left = BLOCK - pos % BLOCK;
        const uint8_t type = buf[pos + 6];
        const size_t hdr = type >= 5 && type <= 8 ? 11 : 7; /* recyclable: + log number */
        const size_t len = (size_t)ld(buf + pos + 4, 2);
        if (left < hdr || (type == 0 && len == 0) || hdr + len > left || pos + hdr + len > size ||
            type > 8) {
            pos += left; /* padding, or a header the damage hit: next block */
            in_record = 0;
            continue;
        }
        const uint8_t *frag = buf + pos + hdr;
        const int kind = type >= 5 ? type - 4 : type; /* 1 full, 2 first, 3 middle, 4 last */
        if (kind == 1) {
            parse_batch(ws, frag, len);
            in_record = 0;
        } else if (kind == 2 || (in_record && (kind == 3 || kind == 4))) {
            if (kind == 2)
                rlen = 0;
            if (rlen + len > cap) {
                size_t nc = (rlen + len) * 2;
                uint8_t *nr = realloc(rec, nc);
                if (!nr)
                    break;
                rec = nr;
                cap = nc;
            }
            memcpy(rec + rlen, frag, len);
            rlen += len;
            in_record = kind != 4;
            if (kind == 4)
                parse_batch(ws, rec, rlen);
        } else {
            in_record = 0;
        }
        pos += hdr + len;
    }
    free(rec);
    free(buf);
}

void *kvd__wal_scan(const char *dir)
{
    wal_writes *ws = calloc(1, sizeof *ws);
    DIR *d = opendir(dir);
    if (!ws || !d) {
        if (d)
            closedir(d);
        return ws;
    }
    struct dirent *de;
    char path[4096];
    while ((de = readdir(d))) {
        size_t n = strlen(de->d_name);
        if (n > 4 && strcmp(de->d_name + n - 4, ".log") == 0 &&
            strspn(de->d_name, "0123456789") == n - 4) {
            snprintf(path, sizeof path, "%s/%s", dir, de->d_name);
            scan_file(ws, path);
        }
    }
    closedir(d);
    return ws;
}

static size_t loss_key(uint8_t *key, const void *id, size_t id_len)
{
    key[0] = KEY_LOSS;
    memcpy(key + 1, id, id_len);
    return 1 + id_len;
}

void kvd__loss_delete(struct rocksdb_writebatch_t *b, const kvd__seq *s)
{
    uint8_t key[1 + KVD_SEQ_ID_MAX];
    rocksdb_writebatch_delete((rocksdb_writebatch_t *)b, (const char *)key,
                              loss_key(key, s->id, s->id_len));
}

static int same_id(const wal_write *a, const wal_write *b)
{
    return a->id_len == b->id_len && memcmp(a->id, b->id, a->id_len) == 0;
}

static int write_cmp(const void *pa, const void *pb)
{
    const wal_write *a = pa, *b = pb;
    size_t n = a->id_len < b->id_len ? a->id_len : b->id_len;
    int c = memcmp(a->id, b->id, n);
    if (c || a->id_len != b->id_len)
        return c ? c : (a->id_len < b->id_len ? -1 : 1);
    return (a->seqno > b->seqno) - (a->seqno < b->seqno);
}

int kvd__wal_losses(kvd_store *st, void *scan, uint64_t latest, kvd_error *err)
{
    wal_writes *ws = scan;
    if (!ws)
        return 0;
    /* The last dropped write of each sequence: sorted by (id, number), the
     * last of each id's run. */
    wal_write **last = calloc(ws->n ? ws->n : 1, sizeof *last);
    size_t nl = 0;
    int rc = 0;
    if (!last) {
        rc = kvd_error_set(err, KVD_ENOMEM, "out of memory");
        goto done;
    }
    qsort(ws->w, ws->n, sizeof *ws->w, write_cmp);
    for (size_t i = 0; i < ws->n; i++) {
        wal_write *w = &ws->w[i];
        if (w->seqno <= latest)
            continue;
        if (nl && same_id(last[nl - 1], w))
            last[nl - 1] = w; /* a later write of the same sequence */
        else
            last[nl++] = w;
    }
    const uint64_t now = (uint64_t)time(NULL) * 1000;
    rocksdb_writebatch_t *b = rocksdb_writebatch_create();
    for (size_t j = 0; j < nl && !rc; j++) {
        const wal_write *w = last[j];
        kvd_seq_info info;
        kvd_error e2;
        int have = kvd_store_seq_stat(st, w->id, w->id_len, &info, &e2) == 0;
        const uint64_t got = have ? info.num_tokens : 0;
        if (have)
            kvd_seq_info_clear(&info);
        kvd_recovery_loss l;
        memset(&l, 0, sizeof l);
        memcpy(l.id, w->id, w->id_len);
        l.id_len = w->id_len;
        l.recovered = got;
        l.exists = have;
        if (w->tokens == -1) {
            if (!have)
                continue; /* deleted, and still gone */
            l.kind = KVD_LOSS_BACK;
        } else if (w->tokens == -2) {
            l.kind = KVD_LOSS_UNKNOWN;
        } else {
            if (have && got >= (uint64_t)w->tokens)
                continue; /* a change that kept its tokens (e.g. its time to live) */
            l.kind = have ? KVD_LOSS_SHORTER : KVD_LOSS_GONE;
            l.acknowledged = (uint64_t)w->tokens;
        }
        kvd_recovery_loss *nl2 = realloc(st->losses, (st->nlosses + 1) * sizeof *nl2);
        if (!nl2) {
            rc = kvd_error_set(err, KVD_ENOMEM, "out of memory");
            break;
        }
        st->losses = nl2;
        st->losses[st->nlosses++] = l;
        if (have) {
            uint8_t key[1 + KVD_SEQ_ID_MAX], val[24];
            for (int i = 0; i < 8; i++) {
                val[i] = (uint8_t)(l.acknowledged >> (8 * i));
                val[8 + i] = (uint8_t)(l.recovered >> (8 * i));
                val[16 + i] = (uint8_t)(now >> (8 * i));
            }
            rocksdb_writebatch_put(b, (const char *)key, loss_key(key, w->id, w->id_len),
                                   (const char *)val, sizeof val);
        }
    }
    if (!rc) {
        char *e = NULL;
        rocksdb_writeoptions_t *wo = rocksdb_writeoptions_create();
        rocksdb_writeoptions_set_sync(wo, 1);
        rocksdb_write(st->db, wo, b, &e);
        rocksdb_writeoptions_destroy(wo);
        if (e) {
            rc = kvd_error_set(err, KVD_EINTERNAL, "recording the recovery's losses: %s", e);
            rocksdb_free(e);
        }
    }
    rocksdb_writebatch_destroy(b);
done:
    free(last);
    return rc;
}

void kvd__wal_scan_free(void *scan)
{
    wal_writes *ws = scan;
    if (ws)
        free(ws->w);
    free(ws);
}

int kvd__loss_get(kvd_store *st, const void *id, size_t id_len, uint64_t *acknowledged,
                  uint64_t *recovered, uint64_t *at_ms)
{
    uint8_t key[1 + KVD_SEQ_ID_MAX];
    size_t len = 0;
    char *e = NULL;
    char *v = rocksdb_get(st->db, st->ropt, (const char *)key, loss_key(key, id, id_len), &len, &e);
    rocksdb_free(e);
    int found = v && len == 24;
    if (found) {
        *acknowledged = ld((const uint8_t *)v, 8);
        *recovered = ld((const uint8_t *)v + 8, 8);
        *at_ms = ld((const uint8_t *)v + 16, 8);
    }
    rocksdb_free(v);
    return found;
}

size_t kvd_store_recovery_losses(const kvd_store *st, const kvd_recovery_loss **out)
{
    *out = st->losses;
    return st->nlosses;
}
