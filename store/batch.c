/*
 * Write batches built in kvdepot's own buffers (store_internal.h,
 * kvd__batch). RocksDB's batch keeps its records in a string that grows by
 * doubling, so a 16 MiB append used to copy its pages about twice more and
 * fault in twice their size of fresh memory. Here the records are laid out
 * in a reused buffer in RocksDB's write-batch format (the one walscan.c
 * reads back from the WAL), page bytes are built in place, and RocksDB gets
 * the whole batch in one piece at the write.
 *
 * Format: a 12-byte header (sequence number, fixed64, and record count,
 * fixed32, little-endian), then records: Put = 0x01, key and value each
 * prefixed by its varint32 length; other records come from a RocksDB batch
 * unchanged (kvd__batch_take).
 */
#include "store_internal.h"

#include <stdlib.h>
#include <string.h>

#define HEADER 12
#define TYPE_PUT 0x01

/* Buffers the store keeps for later appends and batches: KVD__BATCH_KEEP
 * at most, of KEEP_MAX bytes together (a 64 MiB append holds its received
 * bytes and a batch of 64 MiB and a bit). */
#define KEEP_MAX ((size_t)144 << 20)

void kvd__batch_pool_init(kvd_store *st)
{
    pthread_mutex_init(&st->batch_mu, NULL);
}

void kvd__batch_pool_fini(kvd_store *st)
{
    for (size_t i = 0; i < st->nbatch_free; i++)
        free(st->batch_free[i].buf);
    st->nbatch_free = 0;
    atomic_store(&st->batch_kept_bytes, 0);
    pthread_mutex_destroy(&st->batch_mu);
}

uint8_t *kvd__buf_take(kvd_store *st, size_t need, size_t *cap)
{
    uint8_t *buf = NULL;
    pthread_mutex_lock(&st->batch_mu);
    size_t best = st->nbatch_free;
    for (size_t i = 0; i < st->nbatch_free; i++)
        if (st->batch_free[i].cap >= need &&
            (best == st->nbatch_free || st->batch_free[i].cap < st->batch_free[best].cap))
            best = i;
    if (best < st->nbatch_free) {
        buf = st->batch_free[best].buf;
        *cap = st->batch_free[best].cap;
        st->batch_free[best] = st->batch_free[--st->nbatch_free];
        atomic_fetch_sub(&st->batch_kept_bytes, *cap);
    }
    pthread_mutex_unlock(&st->batch_mu);
    if (buf)
        return buf;
    *cap = need;
    return malloc(need ? need : 1);
}

void kvd__buf_give(kvd_store *st, uint8_t *buf, size_t cap)
{
    if (buf && cap <= KEEP_MAX) {
        /* The largest buffers are kept (the costliest to map afresh): buf
         * takes a free slot, or the place of the smallest kept one when it
         * is larger, within KEEP_MAX. */
        pthread_mutex_lock(&st->batch_mu);
        size_t at = st->nbatch_free, kept = atomic_load(&st->batch_kept_bytes);
        uint8_t *out = NULL;
        if (at == KVD__BATCH_KEEP) {
            at = 0;
            for (size_t i = 1; i < st->nbatch_free; i++)
                if (st->batch_free[i].cap < st->batch_free[at].cap)
                    at = i;
            if (st->batch_free[at].cap < cap) {
                out = st->batch_free[at].buf;
                kept -= st->batch_free[at].cap;
            } else {
                at = KVD__BATCH_KEEP; /* no place */
            }
        }
        if (at < KVD__BATCH_KEEP && kept + cap <= KEEP_MAX) {
            st->batch_free[at].buf = buf;
            st->batch_free[at].cap = cap;
            if (at == st->nbatch_free)
                st->nbatch_free++;
            atomic_store(&st->batch_kept_bytes, kept + cap);
            buf = out;
        }
        pthread_mutex_unlock(&st->batch_mu);
    }
    free(buf);
}

void kvd__batch_init(kvd__batch *wb, kvd_store *st, size_t hint)
{
    memset(wb, 0, sizeof *wb);
    wb->st = st;
    if (hint)
        wb->buf = kvd__buf_take(st, hint + HEADER, &wb->cap);
    if (!wb->buf)
        wb->cap = 0;
}

void kvd__batch_release(kvd__batch *wb)
{
    if (wb->st)
        kvd__buf_give(wb->st, wb->buf, wb->cap);
    memset(wb, 0, sizeof *wb);
}

/* Room for n more bytes; 0, or -1 (out of memory: the batch has failed). */
static int grow(kvd__batch *wb, size_t n)
{
    if (wb->failed)
        return -1;
    if (wb->len == 0)
        n += HEADER;
    if (n <= wb->cap - wb->len)
        return 0;
    size_t nc = wb->cap ? wb->cap : (size_t)1 << 20;
    while (nc - wb->len < n) {
        if (nc > SIZE_MAX / 2) {
            wb->failed = 1;
            return -1;
        }
        nc *= 2;
    }
    uint8_t *nb = realloc(wb->buf, nc);
    if (!nb) {
        wb->failed = 1;
        return -1;
    }
    wb->buf = nb;
    wb->cap = nc;
    return 0;
}

static void start(kvd__batch *wb)
{
    if (wb->len == 0) {
        memset(wb->buf, 0, HEADER);
        wb->len = HEADER;
    }
}

/* The header's record count (fixed32, little-endian) after n more. */
static void count(kvd__batch *wb, uint32_t n)
{
    wb->count += n;
    uint8_t *c = wb->buf + 8;
    c[0] = (uint8_t)wb->count;
    c[1] = (uint8_t)(wb->count >> 8);
    c[2] = (uint8_t)(wb->count >> 16);
    c[3] = (uint8_t)(wb->count >> 24);
}

static size_t put_varint32(uint8_t *p, uint32_t v)
{
    size_t n = 0;
    while (v >= 0x80) {
        p[n++] = (uint8_t)(v | 0x80);
        v >>= 7;
    }
    p[n++] = (uint8_t)v;
    return n;
}

int kvd__batch_take(kvd__batch *wb, rocksdb_writebatch_t *b)
{
    int n = rocksdb_writebatch_count(b);
    if (n == 0)
        return 0;
    size_t size = 0;
    const char *rep = rocksdb_writebatch_data(b, &size);
    if (size < HEADER || grow(wb, size - HEADER)) {
        wb->failed = 1;
        return -1;
    }
    start(wb);
    memcpy(wb->buf + wb->len, rep + HEADER, size - HEADER);
    wb->len += size - HEADER;
    count(wb, (uint32_t)n);
    rocksdb_writebatch_clear(b);
    return 0;
}

uint8_t *kvd__batch_put(kvd__batch *wb, rocksdb_writebatch_t *b, const void *key, size_t klen,
                        size_t vlen)
{
    if (klen > UINT32_MAX || vlen > UINT32_MAX) {
        wb->failed = 1;
        return NULL;
    }
    if (b && kvd__batch_take(wb, b))
        return NULL;
    if (grow(wb, 1 + 5 + klen + 5 + vlen))
        return NULL;
    start(wb);
    uint8_t *p = wb->buf + wb->len;
    *p++ = TYPE_PUT;
    p += put_varint32(p, (uint32_t)klen);
    memcpy(p, key, klen);
    p += klen;
    p += put_varint32(p, (uint32_t)vlen);
    wb->len = (size_t)(p - wb->buf) + vlen;
    count(wb, 1);
    return p;
}

int kvd__batch_write(kvd__batch *wb, rocksdb_writebatch_t *b, kvd_error *err)
{
    if (b && kvd__batch_take(wb, b))
        return kvd_error_set(err, KVD_ENOMEM, "out of memory building a write batch");
    if (wb->failed)
        return kvd_error_set(err, KVD_ENOMEM, "out of memory building a write batch");
    if (wb->count == 0)
        return 0;
    rocksdb_writebatch_t *whole = rocksdb_writebatch_create_from((const char *)wb->buf, wb->len);
    int rc = kvd__db_write(wb->st, whole, err);
    rocksdb_writebatch_destroy(whole);
    return rc;
}
