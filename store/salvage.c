/*
 * Page bytes kept through a RocksDB repair (kvd_store_repair).
 *
 * RocksDB 7.8's repair rebuilds the MANIFEST from the table files only: the
 * blob files, which hold every value of 4 KiB or more (the pages), are left
 * out of it and deleted by the next open, although the tables still point
 * into them. So the repair first moves the blob files into a directory of
 * their own (repair-blobs/, each name prefixed with a generation so that a
 * repair interrupted and run again keeps them apart from newer ones), lets
 * RocksDB rebuild the MANIFEST, then reads the blob files back: a record
 * whose key the rebuilt store still has, and cannot read (its blob file is
 * gone), is written again with the record's value. A key the store no
 * longer has (deleted, or its entry lost with a damaged table) is not
 * brought back. Files are read newest first, records last to first, so the
 * newest value of a key is the one written.
 *
 * Blob file format (RocksDB db/blob/blob_log_format.h; integers little
 * endian): a 30-byte header (magic 0x00248f37, version 1, column family,
 * flags, compression, expiration range), records of a 32-byte header (key
 * size u64, value size u64, expiration u64, header CRC, blob CRC) followed
 * by key and value, and, in a file that was closed, a 32-byte footer
 * starting with the magic. The CRCs are masked CRC32C: of the first 24
 * header bytes, and of key then value.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "store_internal.h"

#define BLOB_MAGIC 0x00248f37u
#define BLOB_HEADER 30
#define BLOB_RECORD 32
#define BLOB_FOOTER 32
#define STASH "repair-blobs"

/* CRC32C (Castagnoli, reflected 0x82F63B78), as RocksDB's crc32c::Extend. */
static uint32_t crc_table[256];
static pthread_once_t crc_once = PTHREAD_ONCE_INIT;

static void crc_init(void)
{
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++)
            c = c & 1 ? (c >> 1) ^ 0x82F63B78u : c >> 1;
        crc_table[i] = c;
    }
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) static uint32_t crc_hw(uint32_t l, const uint8_t *p, size_t n)
{
    uint64_t c = l;
    for (; n >= 8; p += 8, n -= 8) {
        uint64_t v;
        memcpy(&v, p, 8);
        c = __builtin_ia32_crc32di(c, v);
    }
    uint32_t c32 = (uint32_t)c;
    for (; n; p++, n--)
        c32 = __builtin_ia32_crc32qi(c32, *p);
    return c32;
}
#endif

uint32_t kvd__crc32c(uint32_t crc, const void *data, size_t n)
{
    const uint8_t *p = data;
    uint32_t l = ~crc;
#if defined(__x86_64__)
    if (__builtin_cpu_supports("sse4.2"))
        return ~crc_hw(l, p, n);
#endif
    pthread_once(&crc_once, crc_init);
    for (; n; p++, n--)
        l = crc_table[(l ^ *p) & 0xff] ^ (l >> 8);
    return ~l;
}

static uint32_t crc_mask(uint32_t c)
{
    return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

static uint64_t le64(const uint8_t *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = v << 8 | p[i];
    return v;
}

static uint32_t le32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* The number of a file named <digits>.blob, after `skip` bytes of name
 * (the generation of a stashed file); -1 for any other name. */
static long long blob_number(const char *name, size_t skip)
{
    size_t n = strlen(name);
    if (n <= skip + 5 || n - skip > 25 || strcmp(name + n - 5, ".blob") != 0)
        return -1;
    long long v = 0;
    for (size_t i = skip; i < n - 5; i++) {
        if (name[i] < '0' || name[i] > '9')
            return -1;
        v = v * 10 + (name[i] - '0');
    }
    return v;
}

/* dir/name into out; -1 when it does not fit. */
static int join(char *out, size_t cap, const char *dir, const char *name)
{
    int n = snprintf(out, cap, "%s/%s", dir, name);
    return n < 0 || (size_t)n >= cap ? -1 : 0;
}

typedef struct stash_file {
    unsigned gen;
    unsigned long long num;
    char name[256];
} stash_file;

static int by_age_desc(const void *a, const void *b)
{
    const stash_file *x = a, *y = b;
    if (x->gen != y->gen)
        return x->gen < y->gen ? 1 : -1;
    return x->num < y->num ? 1 : x->num > y->num ? -1 : 0;
}

/* The stashed files, newest first (*out malloc'd). */
static int list_stash(const char *stash, stash_file **out, size_t *n, unsigned *top_gen)
{
    *out = NULL;
    *n = 0;
    *top_gen = 0;
    DIR *d = opendir(stash);
    if (!d)
        return errno == ENOENT ? 0 : -1;
    size_t cap = 0;
    struct dirent *de;
    while ((de = readdir(d))) {
        const char *dash = strchr(de->d_name, '-');
        long long num = dash ? blob_number(de->d_name, (size_t)(dash - de->d_name) + 1) : -1;
        unsigned gen = 0;
        for (const char *c = de->d_name; dash && c < dash && gen < 1000000; c++)
            gen = *c >= '0' && *c <= '9' ? gen * 10 + (unsigned)(*c - '0') : 1000000;
        if (num < 0 || !dash || dash == de->d_name || gen >= 1000000 ||
            strlen(de->d_name) >= sizeof(*out)->name)
            continue;
        if (*n == cap) {
            cap = cap ? 2 * cap : 16;
            stash_file *g = realloc(*out, cap * sizeof *g);
            if (!g) {
                closedir(d);
                return -1;
            }
            *out = g;
        }
        stash_file *f = &(*out)[(*n)++];
        f->gen = gen;
        f->num = (unsigned long long)num;
        snprintf(f->name, sizeof f->name, "%s", de->d_name);
        if (gen > *top_gen)
            *top_gen = gen;
    }
    closedir(d);
    if (*n)
        qsort(*out, *n, sizeof **out, by_age_desc);
    return 0;
}

int kvd__blob_stash(const char *dir, kvd_error *err)
{
    char stash[4096];
    snprintf(stash, sizeof stash, "%s/%s", dir, STASH);
    if (mkdir(stash, 0700) != 0 && errno != EEXIST)
        return kvd_error_set(err, KVD_EINTERNAL, "repair: cannot create %s: %s", stash,
                             strerror(errno));
    stash_file *old;
    size_t nold;
    unsigned gen;
    if (list_stash(stash, &old, &nold, &gen) != 0)
        return kvd_error_set(err, KVD_EINTERNAL, "repair: cannot list %s: %s", stash,
                             strerror(errno));
    free(old);
    DIR *d = opendir(dir);
    if (!d)
        return kvd_error_set(err, KVD_EINTERNAL, "repair: cannot list %s: %s", dir,
                             strerror(errno));
    int rc = 0;
    struct dirent *de;
    while (rc == 0 && (de = readdir(d))) {
        long long num = blob_number(de->d_name, 0);
        if (num < 0)
            continue;
        char from[4096], to[4096], name[64];
        snprintf(name, sizeof name, "%u-%06lld.blob", gen + 1, num);
        if (join(from, sizeof from, dir, de->d_name) || join(to, sizeof to, stash, name))
            rc = kvd_error_set(err, KVD_EINVAL, "repair: %s: path too long", dir);
        else if (rename(from, to) != 0)
            rc = kvd_error_set(err, KVD_EINTERNAL, "repair: cannot move %s to %s: %s", from, to,
                               strerror(errno));
    }
    closedir(d);
    return rc;
}

/* One stashed file: its records, last to first, written back where the
 * store has their key and cannot read it. 0, or -1 when the file itself
 * cannot be read (a message in why). */
static int replay_file(rocksdb_t *db, rocksdb_readoptions_t *ro, rocksdb_writeoptions_t *wo,
                       const char *path, kvd_blob_salvage *r, char *why, size_t whylen)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    struct stat sb;
    if (fd < 0 || fstat(fd, &sb) != 0) {
        snprintf(why, whylen, "%s", strerror(errno));
        if (fd >= 0)
            close(fd);
        return -1;
    }
    size_t size = (size_t)sb.st_size;
    const uint8_t *m = size ? mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0) : MAP_FAILED;
    close(fd);
    if (m == MAP_FAILED) {
        snprintf(why, whylen, "%s", size ? strerror(errno) : "empty");
        return -1;
    }
    int rc = 0;
    size_t *recs = NULL, nrec = 0, cap = 0;
    if (size < BLOB_HEADER || le32(m) != BLOB_MAGIC || le32(m + 4) != 1 || m[13] != 0) {
        snprintf(why, whylen, "not an uncompressed blob file of version 1");
        rc = -1;
        goto out;
    }
    /* Record offsets first: the records are written back last to first. */
    for (size_t off = BLOB_HEADER; off + BLOB_RECORD <= size;) {
        const uint8_t *h = m + off;
        if (size - off == BLOB_FOOTER && le32(h) == BLOB_MAGIC)
            break;
        if (crc_mask(kvd__crc32c(0, h, 24)) != le32(h + 24)) {
            r->bad_records++; /* a torn or damaged header: the rest is unreadable */
            break;
        }
        uint64_t klen = le64(h), vlen = le64(h + 8);
        if (klen > size || vlen > size || off + BLOB_RECORD + klen + vlen > size) {
            r->bad_records++;
            break;
        }
        if (nrec == cap) {
            cap = cap ? 2 * cap : 256;
            size_t *g = realloc(recs, cap * sizeof *g);
            if (!g) {
                snprintf(why, whylen, "out of memory");
                rc = -1;
                goto out;
            }
            recs = g;
        }
        recs[nrec++] = off;
        off += BLOB_RECORD + klen + vlen;
    }
    for (size_t i = nrec; i-- > 0;) {
        const uint8_t *h = m + recs[i];
        uint64_t klen = le64(h), vlen = le64(h + 8);
        const char *key = (const char *)h + BLOB_RECORD, *val = key + klen;
        r->records++;
        uint32_t c = kvd__crc32c(kvd__crc32c(0, key, klen), val, vlen);
        if (crc_mask(c) != le32(h + 28)) {
            r->bad_records++;
            continue;
        }
        char *e = NULL;
        size_t have = 0;
        char *v = rocksdb_get(db, ro, key, klen, &have, &e);
        if (!e) {
            if (v)
                r->readable++;
            else
                r->unindexed++;
            rocksdb_free(v);
            continue;
        }
        rocksdb_free(e);
        e = NULL;
        rocksdb_put(db, wo, key, klen, val, vlen, &e);
        if (e) {
            snprintf(why, whylen, "writing a record back: %s", e);
            rocksdb_free(e);
            rc = -1;
            goto out;
        }
        r->written++;
    }
out:
    free(recs);
    munmap((void *)m, size);
    return rc;
}

int kvd__blob_replay(const char *dir, rocksdb_options_t *o, kvd_blob_salvage *r, kvd_error *err)
{
    char stash[4096];
    snprintf(stash, sizeof stash, "%s/%s", dir, STASH);
    stash_file *files;
    size_t n;
    unsigned gen;
    if (list_stash(stash, &files, &n, &gen) != 0)
        return kvd_error_set(err, KVD_EINTERNAL, "repair: cannot list %s: %s", stash,
                             strerror(errno));
    char *e = NULL;
    rocksdb_t *db = rocksdb_open(o, dir, &e);
    if (!db) {
        free(files);
        int rc = kvd_error_set(err, KVD_EINTERNAL, "repair: the rebuilt store does not open: %s",
                               e ? e : "?");
        rocksdb_free(e);
        return rc;
    }
    rocksdb_readoptions_t *ro = rocksdb_readoptions_create();
    rocksdb_writeoptions_t *wo = rocksdb_writeoptions_create();
    int rc = 0;
    for (size_t i = 0; i < n && rc == 0; i++) {
        char path[4096], why[300] = "path too long";
        r->files++;
        if (join(path, sizeof path, stash, files[i].name) == 0 &&
            replay_file(db, ro, wo, path, r, why, sizeof why) == 0) {
            unlink(path);
        } else if (!strncmp(why, "writing", 7) || !strcmp(why, "out of memory")) {
            rc = kvd_error_set(err, KVD_EINTERNAL, "repair: %s: %s", path, why);
        } else if (!r->unreadable++) {
            snprintf(r->first_unreadable, sizeof r->first_unreadable, "%.250s: %.140s",
                     files[i].name, why);
        }
    }
    rocksdb_flushoptions_t *fo = rocksdb_flushoptions_create();
    rocksdb_flushoptions_set_wait(fo, 1);
    if (rc == 0) {
        rocksdb_flush(db, fo, &e);
        if (e) {
            rc = kvd_error_set(err, KVD_EINTERNAL, "repair: flushing what was written back: %s", e);
            rocksdb_free(e);
        }
    }
    rocksdb_flushoptions_destroy(fo);
    rocksdb_writeoptions_destroy(wo);
    rocksdb_readoptions_destroy(ro);
    rocksdb_close(db);
    free(files);
    if (rc == 0 && !r->unreadable)
        rmdir(stash);
    return rc;
}

int kvd__seq_ids_unverified(const char *dir, kvd_repair_report *r)
{
    rocksdb_options_t *o = rocksdb_options_create();
    rocksdb_options_set_paranoid_checks(o, 0);
    rocksdb_options_set_enable_blob_files(o, 1);
    char *e = NULL;
    rocksdb_t *db = rocksdb_open_for_read_only(o, dir, 0, &e);
    rocksdb_options_destroy(o);
    rocksdb_free(e);
    if (!db)
        return 0;
    rocksdb_readoptions_t *ro = rocksdb_readoptions_create();
    rocksdb_readoptions_set_verify_checksums(ro, 0);
    rocksdb_iterator_t *it = rocksdb_create_iterator(db, ro);
    int rc = 0;
    size_t cap = 0;
    const char first = KVD__KEY_SEQ;
    for (rocksdb_iter_seek(it, &first, 1); rc == 0 && rocksdb_iter_valid(it);
         rocksdb_iter_next(it)) {
        size_t klen;
        const char *k = rocksdb_iter_key(it, &klen);
        if (!klen || k[0] != KVD__KEY_SEQ)
            break;
        if (klen < 2 || klen - 1 > KVD_SEQ_ID_MAX)
            continue;
        if (r->nids == cap) {
            cap = cap ? 2 * cap : 64;
            uint8_t **ids = realloc(r->ids, cap * sizeof *ids);
            if (ids)
                r->ids = ids;
            size_t *lens = ids ? realloc(r->id_lens, cap * sizeof *lens) : NULL;
            if (lens)
                r->id_lens = lens;
            if (!ids || !lens) {
                rc = KVD_ENOMEM;
                break;
            }
        }
        uint8_t *id = malloc(klen - 1);
        if (!id) {
            rc = KVD_ENOMEM;
            break;
        }
        memcpy(id, k + 1, klen - 1);
        r->ids[r->nids] = id;
        r->id_lens[r->nids++] = klen - 1;
    }
    rocksdb_iter_destroy(it);
    rocksdb_readoptions_destroy(ro);
    rocksdb_close(db);
    return rc;
}

void kvd_repair_report_clear(kvd_repair_report *r)
{
    for (size_t i = 0; i < r->nids; i++)
        free(r->ids[i]);
    free(r->ids);
    free(r->id_lens);
    r->ids = NULL;
    r->id_lens = NULL;
    r->nids = 0;
}
