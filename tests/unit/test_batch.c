/*
 * Write batches built in kvdepot's buffers (store/batch.c):
 *
 *  - records added through kvd__batch_put, interleaved with records added to
 *    a RocksDB batch, give byte for byte the batch RocksDB builds from the
 *    same operations in the same order (header, record count, varint
 *    lengths of one, two and three bytes, deletes and range deletes);
 *  - such a batch written to a store is what RocksDB then holds: the puts
 *    read back, the deletes and the range delete took effect;
 *  - a batch that could not grow writes nothing and says so;
 *  - a finished batch's buffer is kept and handed to the next batch, within
 *    the number and bytes the store keeps;
 *  - appends of raw pages (built in place in the batch: whole pages, a page
 *    completing the tail, a tail fragment) read back exact after a reopen;
 *  - compactions leave the blob files (page bytes) alone, and kvd__blob_gc
 *    rewrites them only once deleted pages fill half of them (and at least
 *    the bytes it is given): then the live pages alone remain, exact.
 */
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <rocksdb/c.h>

#include "store.h"
#include "store_internal.h"

static int failures;
#define CHECK(cond)                                                                                \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond);               \
            failures++;                                                                            \
        }                                                                                          \
    } while (0)

static char dir[256];

static void rm_dir(void)
{
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0)
        fprintf(stderr, "could not remove %s\n", dir);
}

#define PT 16 /* page tokens */

static kvd_store *open_store(void)
{
    kvd_store_options o = {.data_dir = dir, .page_tokens = PT};
    kvd_store *st = NULL;
    kvd_error err;
    if (kvd_store_open(&o, &st, &err) != 0) {
        fprintf(stderr, "open %s: %s\n", dir, err.msg);
        exit(1);
    }
    return st;
}

static void fill(uint8_t *p, size_t n, unsigned seed)
{
    for (size_t i = 0; i < n; i++)
        p[i] = (uint8_t)(seed * 131u + i * 7u + (i >> 8));
}

/* Put key with a value of n bytes made by fill(seed) through wb (after b's
 * records) and through ref. */
static void put_both(kvd__batch *wb, rocksdb_writebatch_t *b, rocksdb_writebatch_t *ref,
                     const char *key, size_t n, unsigned seed)
{
    uint8_t *v = malloc(n ? n : 1);
    fill(v, n, seed);
    uint8_t *dst = kvd__batch_put(wb, b, key, strlen(key), n);
    CHECK(dst != NULL);
    if (dst)
        memcpy(dst, v, n);
    rocksdb_writebatch_put(ref, key, strlen(key), (const char *)v, n);
    free(v);
}

static void test_format(kvd_store *st)
{
    kvd__batch wb;
    kvd__batch_init(&wb, st, 0);
    rocksdb_writebatch_t *b = rocksdb_writebatch_create();
    rocksdb_writebatch_t *ref = rocksdb_writebatch_create();

    /* b's records before the first put, between puts, and after the last */
    rocksdb_writebatch_delete(b, "gone0", 5);
    rocksdb_writebatch_delete(ref, "gone0", 5);
    put_both(&wb, b, ref, "k1", 10, 1);  /* one-byte length */
    put_both(&wb, b, ref, "k2", 0, 2);   /* empty value */
    put_both(&wb, b, ref, "k3", 300, 3); /* two-byte length */
    rocksdb_writebatch_delete(b, "gone1", 5);
    rocksdb_writebatch_delete(ref, "gone1", 5);
    rocksdb_writebatch_delete_range(b, "r0", 2, "r9", 2);
    rocksdb_writebatch_delete_range(ref, "r0", 2, "r9", 2);
    put_both(&wb, b, ref, "k4", 70000, 4);          /* three-byte length */
    put_both(&wb, b, ref, "k5", (1u << 21) + 5, 5); /* past the first buffer */
    rocksdb_writebatch_put(b, "small", 5, "x", 1);
    rocksdb_writebatch_put(ref, "small", 5, "x", 1);
    CHECK(kvd__batch_take(&wb, b) == 0);
    CHECK(rocksdb_writebatch_count(b) == 0);

    size_t rlen = 0;
    const char *rep = rocksdb_writebatch_data(ref, &rlen);
    CHECK(wb.len == rlen);
    CHECK(wb.count == (uint32_t)rocksdb_writebatch_count(ref));
    CHECK(wb.len == rlen && memcmp(wb.buf, rep, rlen) == 0);
    /* RocksDB reads it back as the same batch */
    rocksdb_writebatch_t *back = rocksdb_writebatch_create_from((const char *)wb.buf, wb.len);
    CHECK(rocksdb_writebatch_count(back) == rocksdb_writebatch_count(ref));
    rocksdb_writebatch_destroy(back);

    rocksdb_writebatch_destroy(b);
    rocksdb_writebatch_destroy(ref);
    kvd__batch_release(&wb);
}

static int get_eq(kvd_store *st, const char *key, const uint8_t *want, size_t n)
{
    char *e = NULL;
    size_t len = 0;
    char *v = rocksdb_get(st->db, st->ropt, key, strlen(key), &len, &e);
    int ok = !e && v && len == n && memcmp(v, want, n) == 0;
    rocksdb_free(e);
    rocksdb_free(v);
    return ok;
}

static int absent(kvd_store *st, const char *key)
{
    char *e = NULL;
    size_t len = 0;
    char *v = rocksdb_get(st->db, st->ropt, key, strlen(key), &len, &e);
    int ok = !e && !v;
    rocksdb_free(e);
    rocksdb_free(v);
    return ok;
}

static void put_raw(kvd_store *st, const char *key, const char *val)
{
    char *e = NULL;
    rocksdb_put(st->db, st->wopt, key, strlen(key), val, strlen(val), &e);
    CHECK(e == NULL);
    rocksdb_free(e);
}

static void test_write(kvd_store *st)
{
    put_raw(st, "~t-old", "o");
    put_raw(st, "~t-r5", "r");
    kvd__batch wb;
    kvd__batch_init(&wb, st, 0);
    rocksdb_writebatch_t *b = rocksdb_writebatch_create();
    uint8_t v[5000];
    fill(v, sizeof v, 9);
    uint8_t *dst = kvd__batch_put(&wb, b, "~t-new", 6, sizeof v);
    CHECK(dst != NULL);
    if (dst)
        memcpy(dst, v, sizeof v);
    rocksdb_writebatch_delete(b, "~t-old", 6);
    rocksdb_writebatch_delete_range(b, "~t-r0", 5, "~t-r9", 5);
    rocksdb_writebatch_put(b, "~t-last", 7, "L", 1);
    kvd_error err;
    CHECK(kvd__batch_write(&wb, b, &err) == 0);
    CHECK(get_eq(st, "~t-new", v, sizeof v));
    CHECK(get_eq(st, "~t-last", (const uint8_t *)"L", 1));
    CHECK(absent(st, "~t-old"));
    CHECK(absent(st, "~t-r5"));
    rocksdb_writebatch_destroy(b);
    kvd__batch_release(&wb);

    /* a value too large for the format fails the batch: nothing written */
    kvd__batch_init(&wb, st, 0);
    b = rocksdb_writebatch_create();
    CHECK(kvd__batch_put(&wb, b, "~t-a", 4, 3) != NULL);
    CHECK(kvd__batch_put(&wb, b, "~t-huge", 7, (size_t)UINT32_MAX + 1) == NULL);
    rocksdb_writebatch_put(b, "~t-b", 4, "b", 1);
    memset(&err, 0, sizeof err);
    CHECK(kvd__batch_write(&wb, b, &err) == KVD_ENOMEM);
    CHECK(strstr(err.msg, "write batch") != NULL);
    CHECK(absent(st, "~t-a") && absent(st, "~t-b") && absent(st, "~t-huge"));
    rocksdb_writebatch_destroy(b);
    kvd__batch_release(&wb);
}

static void test_pool(kvd_store *st)
{
    /* take what earlier tests left */
    uint8_t *left[KVD__BATCH_KEEP];
    size_t lcap[KVD__BATCH_KEEP];
    for (int i = 0; i < KVD__BATCH_KEEP; i++)
        left[i] = kvd__buf_take(st, 1, &lcap[i]);
    CHECK(st->nbatch_free == 0 && st->batch_kept_bytes == 0);
    for (int i = 0; i < KVD__BATCH_KEEP; i++)
        free(left[i]);

    /* nothing kept: a new buffer of the size asked for */
    size_t cap = 0;
    uint8_t *a = kvd__buf_take(st, 3u << 20, &cap);
    CHECK(a != NULL && cap == 3u << 20);
    size_t bcap = 0;
    uint8_t *b = kvd__buf_take(st, 1u << 20, &bcap);
    CHECK(b != NULL && bcap == 1u << 20);
    kvd__buf_give(st, a, cap);
    kvd__buf_give(st, b, bcap);
    CHECK(st->nbatch_free == 2 && st->batch_kept_bytes == (4u << 20));
    /* the smallest kept buffer that is large enough */
    size_t got = 0;
    uint8_t *c = kvd__buf_take(st, 2u << 20, &got);
    CHECK(c == a && got == 3u << 20);
    uint8_t *d = kvd__buf_take(st, 2u << 20, &got); /* none left that large */
    CHECK(d != a && d != b && got == 2u << 20);
    CHECK(st->nbatch_free == 1 && st->batch_kept_bytes == (1u << 20));
    /* no more than KVD__BATCH_KEEP kept: the largest ones */
    kvd__buf_give(st, c, 3u << 20);
    kvd__buf_give(st, d, 2u << 20); /* in place of the 1 MiB one */
    CHECK(st->nbatch_free == KVD__BATCH_KEEP && st->batch_kept_bytes == (5u << 20));
    uint8_t *e = kvd__buf_take(st, 1, &got);
    CHECK(e == d && got == 2u << 20);
    kvd__buf_give(st, e, got);
    uint8_t *small = malloc(1000);
    kvd__buf_give(st, small, 1000); /* smaller than any kept: freed */
    CHECK(st->nbatch_free == KVD__BATCH_KEEP && st->batch_kept_bytes == (5u << 20));
    /* nor more bytes than the store keeps */
    for (int i = 0; i < KVD__BATCH_KEEP; i++)
        free(kvd__buf_take(st, 1, &got));
    uint8_t *big = kvd__buf_take(st, (size_t)100 << 20, &got);
    uint8_t *big2 = kvd__buf_take(st, (size_t)100 << 20, &got);
    kvd__buf_give(st, big, (size_t)100 << 20);
    kvd__buf_give(st, big2, (size_t)100 << 20);
    CHECK(st->nbatch_free == 1 && st->batch_kept_bytes == (size_t)100 << 20);
    uint8_t *huge = kvd__buf_take(st, (size_t)200 << 20, &got);
    CHECK(got == (size_t)200 << 20);
    kvd__buf_give(st, huge, got);
    CHECK(st->nbatch_free == 1 && st->batch_kept_bytes == (size_t)100 << 20);

    /* a batch starts in a kept buffer and gives it back */
    kvd__batch wb;
    kvd__batch_init(&wb, st, 1000);
    CHECK(wb.buf == big && wb.cap == (size_t)100 << 20 && wb.len == 0 && wb.count == 0);
    CHECK(kvd__batch_put(&wb, NULL, "z", 1, 1) != NULL && wb.count == 1 && wb.len == 12 + 5);
    kvd__batch_release(&wb);
    CHECK(st->nbatch_free == 1 && st->batch_kept_bytes == (size_t)100 << 20);
    for (int i = 0; i < KVD__BATCH_KEEP; i++)
        free(kvd__buf_take(st, 1, &got));
}

/* Sequences of one layer, H kv heads x D, f16; content a function of
 * (sequence, part, token). */
#define H 2
#define D 64
#define ROW (H * D * 2)

static void gen(uint8_t *p, int seq, uint64_t t0, uint64_t n, int part)
{
    for (uint64_t t = 0; t < n; t++)
        for (size_t i = 0; i < ROW; i++)
            p[t * ROW + i] =
                (uint8_t)((t0 + t) * 29u + i * 3u + (unsigned)part * 101u + (unsigned)seq * 57u);
}

static void seq_name(char *id, int seq)
{
    snprintf(id, 16, "s%d", seq);
}

static void append(kvd_store *st, int seq, uint64_t t0, uint64_t n)
{
    char id[16];
    seq_name(id, seq);
    kvd_append_spec sp = {.seq_id = id,
                          .seq_id_len = strlen(id),
                          .token_start = t0,
                          .num_tokens = n,
                          .dtype = KVD_DTYPE_F16};
    kvd_append *ap;
    uint64_t want;
    kvd_error err;
    CHECK(kvd_store_append_begin(st, &sp, &ap, &want, &err) == 0);
    CHECK(want == 2 * n * ROW);
    uint8_t *buf = malloc(2 * n * ROW);
    gen(buf, seq, t0, n, 0);
    gen(buf + n * ROW, seq, t0, n, 1);
    CHECK(kvd_store_append_write(ap, buf, 2 * n * ROW, &err) == 0);
    CHECK(kvd_store_append_commit(ap, NULL, &err) == 0);
    free(buf);
}

static void check_read(kvd_store *st, int seq, uint64_t n)
{
    char id[16];
    seq_name(id, seq);
    uint8_t *got = malloc(2 * n * ROW), *want = malloc(2 * n * ROW);
    gen(want, seq, 0, n, 0);
    gen(want + n * ROW, seq, 0, n, 1);
    kvd_read_spec rs = {.seq_id = id, .seq_id_len = strlen(id)};
    kvd_read *rd = NULL;
    kvd_read_shape sh;
    kvd_error err;
    size_t have = 0, len = 1;
    CHECK(kvd_store_read_begin(st, &rs, &rd, &sh, &err) == 0);
    CHECK(sh.num_tokens == n && sh.total_bytes == 2 * n * ROW);
    while (rd && len && have < 2 * n * ROW &&
           kvd_store_read_next(rd, got + have, 2 * n * ROW - have, &len, &err) == 0)
        have += len;
    kvd_store_read_end(rd);
    CHECK(have == 2 * n * ROW && memcmp(got, want, 2 * n * ROW) == 0);
    free(got);
    free(want);
}

static void create(kvd_store *st, int seq)
{
    char id[16];
    seq_name(id, seq);
    kvd_error err;
    CHECK(kvd_store_seq_create(st, id, strlen(id), "m", NULL, 0, NULL, 0, NULL, &err) == 0);
}

static kvd_store *open_with_model(void)
{
    kvd_store *st = open_store();
    kvd_model_info mi = {
        .name = "m", .num_layers = 1, .num_kv_heads = H, .head_dim = D, .dtype = KVD_DTYPE_F16};
    kvd_error err;
    CHECK(kvd_store_model_put(st, &mi, 0, NULL, NULL, &err) == 0);
    return st;
}

static void test_pages(void)
{
    kvd_store *st = open_with_model();
    create(st, 0);
    append(st, 0, 0, 3 * PT + 5);  /* three pages and a tail */
    append(st, 0, 3 * PT + 5, 4);  /* a fragment of the tail */
    append(st, 0, 3 * PT + 9, PT); /* completes the tail, starts another */
    check_read(st, 0, 4 * PT + 9);
    kvd_store_close(st);
    st = open_store();
    check_read(st, 0, 4 * PT + 9);
    kvd_store_close(st);
}

static uint64_t prop(kvd_store *st, const char *name)
{
    uint64_t v = 0;
    CHECK(rocksdb_property_int(st->db, name, &v) == 0);
    return v;
}

static void flush(kvd_store *st)
{
    rocksdb_flushoptions_t *fo = rocksdb_flushoptions_create();
    rocksdb_flushoptions_set_wait(fo, 1);
    char *e = NULL;
    rocksdb_flush(st->db, fo, &e);
    CHECK(e == NULL);
    rocksdb_free(e);
    rocksdb_flushoptions_destroy(fo);
}

/* Blob files (page bytes) are compacted only once deleted pages fill half
 * of them: 8 sequences written in rounds, so that every blob file holds
 * pages of each; deleting some leaves every file partly alive. */
static void test_blob_gc(void)
{
    enum { SEQS = 8, ROUNDS = 6 };
    kvd_store *st = open_with_model();
    for (int s = 0; s < SEQS; s++)
        create(st, s);
    for (int r = 0; r < ROUNDS; r++) {
        for (int s = 0; s < SEQS; s++)
            append(st, s, (uint64_t)r * 4 * PT, 4 * PT);
        flush(st);
    }
    const uint64_t files = prop(st, "rocksdb.num-blob-files");
    const uint64_t full = prop(st, "rocksdb.live-blob-file-size");
    CHECK(files >= ROUNDS);
    CHECK(full >= (uint64_t)SEQS * ROUNDS * 4 * PT * 2 * ROW);
    kvd_error err;
    char id[16];
    /* a quarter deleted: compactions count it as garbage, and keep it */
    for (int s = 0; s < 2; s++) {
        seq_name(id, s);
        CHECK(kvd_store_seq_delete(st, id, strlen(id), NULL, &err) == 0);
    }
    flush(st);
    rocksdb_compact_range(st->db, NULL, 0, NULL, 0);
    const uint64_t g1 = prop(st, "rocksdb.live-blob-file-garbage-size");
    CHECK(g1 >= full / 5);
    CHECK(prop(st, "rocksdb.live-blob-file-size") == full); /* nothing rewritten */
    int ran = -1;
    CHECK(kvd__blob_gc(st, 0, &ran) == 0 && ran == 0);
    /* three quarters: past half, but not past the minimum asked for */
    for (int s = 2; s < 6; s++) {
        seq_name(id, s);
        CHECK(kvd_store_seq_delete(st, id, strlen(id), NULL, &err) == 0);
    }
    flush(st);
    rocksdb_compact_range(st->db, NULL, 0, NULL, 0);
    const uint64_t g2 = prop(st, "rocksdb.live-blob-file-garbage-size");
    CHECK(g2 * 2 >= full && prop(st, "rocksdb.live-blob-file-size") == full);
    CHECK(kvd__blob_gc(st, full, &ran) == 0 && ran == 0);
    /* and then it runs: what is left is the live pages alone */
    CHECK(kvd__blob_gc(st, 0, &ran) == 0 && ran == 1);
    const uint64_t after = prop(st, "rocksdb.live-blob-file-size");
    CHECK(after < full / 3 && after > full / 5); /* a quarter alive */
    CHECK(prop(st, "rocksdb.live-blob-file-garbage-size") == 0);
    for (int s = 6; s < SEQS; s++)
        check_read(st, s, (uint64_t)ROUNDS * 4 * PT);
    /* compactions after it leave the files alone again */
    append(st, 6, (uint64_t)ROUNDS * 4 * PT, 4 * PT);
    flush(st);
    seq_name(id, 7);
    CHECK(kvd_store_seq_delete(st, id, strlen(id), NULL, &err) == 0);
    flush(st);
    rocksdb_compact_range(st->db, NULL, 0, NULL, 0);
    CHECK(prop(st, "rocksdb.live-blob-file-garbage-size") > 0);
    kvd_store_close(st);
    st = open_store();
    check_read(st, 6, (uint64_t)(ROUNDS + 1) * 4 * PT);
    kvd_store_close(st);
}

/* A MANIFEST rebuilt by RocksDB's repair: the records come back from the
 * tables, the blob files (page bytes) cannot, so they are moved into
 * repair-blobs/ (nothing deleted) and their pages answer DATA_LOSS, never
 * other bytes; the sequence ids are listed before the repair when the store
 * opens, and a repair that moves nothing leaves no directory behind. */
static void test_repair_blobs(void)
{
    kvd_store *st = open_with_model();
    for (int s = 0; s < 4; s++)
        create(st, s);
    for (int r = 0; r < 2; r++) { /* two blob files */
        for (int s = 0; s < 4; s++)
            append(st, s, (uint64_t)r * 4 * PT, 4 * PT);
        flush(st);
    }
    kvd_error err;
    CHECK(kvd_store_seq_delete(st, "s0", 2, NULL, &err) == 0);
    kvd_store_close(st);
    /* A sound store first: the ids are listed, the blob files moved. */
    int how = 0;
    kvd_repair_report rep;
    kvd_error_clear(&err);
    CHECK(kvd_store_repair(dir, &how, &rep, &err) == 0 && how == 2);
    if (err.msg[0])
        fprintf(stderr, "repair: %s\n", err.msg);
    CHECK(rep.blob_files == 2);
    CHECK(rep.nids == 3 && rep.id_lens[0] == 2 && !memcmp(rep.ids[0], "s1", 2) &&
          !memcmp(rep.ids[2], "s3", 2));
    kvd_repair_report_clear(&rep);
    char path[512];
    int moved = 0, left = 0;
    snprintf(path, sizeof path, "%s/repair-blobs", dir);
    DIR *d = opendir(path);
    struct dirent *de;
    while (d && (de = readdir(d)))
        moved += strncmp(de->d_name, "1-", 2) == 0 && strstr(de->d_name, ".blob") != NULL;
    if (d)
        closedir(d);
    d = opendir(dir);
    while (d && (de = readdir(d)))
        left += strstr(de->d_name, ".blob") != NULL;
    if (d)
        closedir(d);
    CHECK(moved == 2 && left == 0);
    st = open_store();
    for (int s = 1; s < 4; s++) { /* the records are there, their pages DATA_LOSS */
        char id[16];
        seq_name(id, s);
        kvd_seq_info info;
        CHECK(kvd_store_seq_stat(st, id, strlen(id), &info, &err) == 0 &&
              info.num_tokens == 8 * PT);
        kvd_seq_info_clear(&info);
        kvd_page_handle h;
        CHECK(kvd_store_page_acquire(st, id, strlen(id), 0, 0, &h, &err) == KVD_ECORRUPT);
    }
    kvd_store_close(st);
    /* Without its MANIFEST the store does not open to list the ids; a
     * second repair moves nothing more and keeps what the first moved. */
    d = opendir(dir);
    while (d && (de = readdir(d)))
        if (!strncmp(de->d_name, "MANIFEST-", 9)) {
            snprintf(path, sizeof path, "%s/%s", dir, de->d_name);
            CHECK(unlink(path) == 0);
        }
    if (d)
        closedir(d);
    CHECK(kvd_store_repair(dir, &how, &rep, &err) == 0 && how == 2);
    CHECK(rep.nids == 0 && rep.blob_files == 0);
    kvd_repair_report_clear(&rep);
    moved = 0;
    snprintf(path, sizeof path, "%s/repair-blobs", dir);
    d = opendir(path);
    while (d && (de = readdir(d)))
        moved += strstr(de->d_name, ".blob") != NULL;
    if (d)
        closedir(d);
    CHECK(moved == 2);
    st = open_store();
    kvd_seq_info info;
    CHECK(kvd_store_seq_stat(st, "s2", 2, &info, &err) == 0 && info.num_tokens == 8 * PT);
    kvd_seq_info_clear(&info);
    kvd_store_close(st);
}

/* A data directory written by a newer kvdepot (its store record's format
 * above KVD_STORE_FORMAT) is refused with the way forward and left as it
 * was; back at this format it opens. */
static void test_format_version(void)
{
    kvd_store *st = open_with_model();
    create(st, 0);
    append(st, 0, 0, PT);
    uint8_t rec[6] = {KVD_STORE_FORMAT + 1, 0, 1, 0, 0, 7}; /* a longer record, too */
    char *e = NULL;
    rocksdb_put(st->db, st->wopt, KVD__META_KEY, KVD__META_KEY_LEN, (const char *)rec, sizeof rec,
                &e);
    CHECK(e == NULL);
    kvd_store_close(st);
    kvd_store_options o = {.data_dir = dir};
    kvd_error err;
    kvd_error_clear(&err);
    st = NULL;
    CHECK(kvd_store_open(&o, &st, &err) == KVD_EPRECOND && st == NULL);
    CHECK(strstr(err.msg, "newer kvdepot (store format 2; this kvdepotd reads format 1") != NULL);
    /* untouched: put the record back as this format writes it */
    rocksdb_options_t *ro = rocksdb_options_create();
    rocksdb_options_set_enable_blob_files(ro, 1);
    rocksdb_t *db = rocksdb_open(ro, dir, &e);
    CHECK(db && e == NULL);
    size_t len = 0;
    rocksdb_readoptions_t *rd = rocksdb_readoptions_create();
    char *v = db ? rocksdb_get(db, rd, KVD__META_KEY, KVD__META_KEY_LEN, &len, &e) : NULL;
    CHECK(v && len == sizeof rec && memcmp(v, rec, len) == 0);
    rocksdb_free(v);
    uint8_t cur[5] = {KVD_STORE_FORMAT, (uint8_t)PT, (uint8_t)(PT >> 8), 0, 0};
    rocksdb_writeoptions_t *wo = rocksdb_writeoptions_create();
    if (db)
        rocksdb_put(db, wo, KVD__META_KEY, KVD__META_KEY_LEN, (const char *)cur, sizeof cur, &e);
    CHECK(e == NULL);
    rocksdb_writeoptions_destroy(wo);
    rocksdb_readoptions_destroy(rd);
    if (db)
        rocksdb_close(db);
    rocksdb_options_destroy(ro);
    st = open_store();
    check_read(st, 0, PT);
    kvd_store_close(st);
}

int main(void)
{
    const char *t = getenv("TMPDIR");
    snprintf(dir, sizeof dir, "%s/kvd_batch_%d", t && t[0] ? t : "/tmp", (int)getpid());
    rm_dir();
    kvd_store *st = open_store();
    test_format(st);
    test_write(st);
    test_pool(st);
    kvd_store_close(st);
    rm_dir();
    test_pages();
    rm_dir();
    test_blob_gc();
    rm_dir();
    test_repair_blobs();
    rm_dir();
    test_format_version();
    rm_dir();
    if (failures) {
        fprintf(stderr, "%d check(s) failed\n", failures);
        return 1;
    }
    printf("batch: all checks passed\n");
    return 0;
}
