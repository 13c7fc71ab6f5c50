/*
 * What a RocksDB repair must not lose (kvd_store_repair).
 *
 * RocksDB 7.8's repair rebuilds the MANIFEST from the table files only: the
 * blob files, which hold every value of 4 KiB or more (the pages), are left
 * out of it, and the next open would delete them as obsolete. Writing their
 * records back into the rebuilt store is not possible through the C API
 * (the rebuilt tables still link the old blob file numbers, and RocksDB's
 * consistency check refuses the next version that lacks them), so the
 * repair moves them into a directory of their own (repair-blobs/, each name
 * prefixed with a generation so that a repair run again keeps them apart
 * from newer ones): the page bytes stay on disk for an operator, and their
 * pages answer DATA_LOSS in the repaired store.
 *
 * The sequence ids the store held are listed before the repair (read-only,
 * checksums not verified, so a damaged table does not stop the listing):
 * kvdepotd repair names those the repaired store lacks.
 */
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "store_internal.h"

#define STASH "repair-blobs"

/* The number of a file named <digits>.blob, after `skip` bytes of name
 * (the generation of a moved file); -1 for any other name. */
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

/* The highest generation among the files already moved (0: none). */
static unsigned top_generation(const char *stash)
{
    unsigned top = 0;
    DIR *d = opendir(stash);
    struct dirent *de;
    while (d && (de = readdir(d))) {
        const char *dash = strchr(de->d_name, '-');
        if (!dash || dash == de->d_name ||
            blob_number(de->d_name, (size_t)(dash - de->d_name) + 1) < 0)
            continue;
        unsigned gen = 0;
        for (const char *c = de->d_name; c < dash && gen < 1000000; c++)
            gen = *c >= '0' && *c <= '9' ? gen * 10 + (unsigned)(*c - '0') : 1000000;
        if (gen < 1000000 && gen > top)
            top = gen;
    }
    if (d)
        closedir(d);
    return top;
}

int kvd__blob_stash(const char *dir, uint64_t *moved, kvd_error *err)
{
    *moved = 0;
    char stash[4096];
    if (join(stash, sizeof stash, dir, STASH))
        return kvd_error_set(err, KVD_EINVAL, "repair: %s: path too long", dir);
    if (mkdir(stash, 0700) != 0 && errno != EEXIST)
        return kvd_error_set(err, KVD_EINTERNAL, "repair: cannot create %s: %s", stash,
                             strerror(errno));
    const unsigned gen = top_generation(stash) + 1;
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
        snprintf(name, sizeof name, "%u-%06lld.blob", gen, num);
        if (join(from, sizeof from, dir, de->d_name) || join(to, sizeof to, stash, name))
            rc = kvd_error_set(err, KVD_EINVAL, "repair: %s: path too long", dir);
        else if (rename(from, to) != 0)
            rc = kvd_error_set(err, KVD_EINTERNAL, "repair: cannot move %s to %s: %s", from, to,
                               strerror(errno));
        else
            (*moved)++;
    }
    closedir(d);
    rmdir(stash); /* only when empty: nothing was moved, now or before */
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
