/*
 * RocksDB's CRC32C computed by ISA-L (store/crc32c.c):
 *
 *  - RocksDB's own calls reach kvdepot's function: a store written (its
 *    write-ahead log, a blob file of a large value) and read back counts
 *    calls, and kvd_store_crc32c() says "isa-l";
 *  - the values are RocksDB's own function's bit for bit (the library's
 *    definition, found through its handle), on the standard check value,
 *    on random bytes of every length to 300 and larger ones at odd
 *    addresses, from random starting CRCs, and in pieces (Extend of Extend
 *    is Extend of the whole): files stay readable by any RocksDB.
 */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <rocksdb/c.h>

#include "store.h"
#include "store_internal.h"

static int failures;
#define CHECK(cond, ...)                                                                           \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "%s:%d: CHECK failed: %s: ", __FILE__, __LINE__, #cond);               \
            fprintf(stderr, __VA_ARGS__);                                                          \
            fputc('\n', stderr);                                                                   \
            failures++;                                                                            \
        }                                                                                          \
    } while (0)

#define EXTEND "_ZN7rocksdb6crc32c6ExtendEjPKcm"
typedef uint32_t (*extend_fn)(uint32_t, const char *, size_t);

static uint64_t rng = 0x9E3779B97F4A7C15ull;
static uint64_t next(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}

/* Write a large value (a blob file) and a small one through the log,
 * flush, reopen, read both back. */
static void store_round_trip(const char *dir)
{
    char *err = NULL;
    rocksdb_options_t *o = rocksdb_options_create();
    rocksdb_options_set_create_if_missing(o, 1);
    rocksdb_options_set_enable_blob_files(o, 1);
    rocksdb_options_set_min_blob_size(o, 4096);
    rocksdb_t *db = rocksdb_open(o, dir, &err);
    CHECK(db && !err, "open: %s", err ? err : "");
    if (!db) {
        rocksdb_free(err);
        rocksdb_options_destroy(o);
        return;
    }
    size_t big = (1 << 20) + 3;
    char *v = malloc(big);
    for (size_t i = 0; i < big; i++)
        v[i] = (char)next();
    rocksdb_writeoptions_t *wo = rocksdb_writeoptions_create();
    rocksdb_put(db, wo, "big", 3, v, big, &err);
    CHECK(!err, "put: %s", err ? err : "");
    rocksdb_put(db, wo, "small", 5, "value", 5, &err);
    CHECK(!err, "put: %s", err ? err : "");
    rocksdb_flushoptions_t *fo = rocksdb_flushoptions_create();
    rocksdb_flush(db, fo, &err);
    CHECK(!err, "flush: %s", err ? err : "");
    rocksdb_close(db);
    db = rocksdb_open(o, dir, &err);
    CHECK(db && !err, "reopen: %s", err ? err : "");
    rocksdb_readoptions_t *ro = rocksdb_readoptions_create();
    rocksdb_readoptions_set_verify_checksums(ro, 1);
    size_t len = 0;
    char *got = db ? rocksdb_get(db, ro, "big", 3, &len, &err) : NULL;
    CHECK(got && !err && len == big && memcmp(got, v, big) == 0, "read back: %s", err ? err : "");
    rocksdb_free(got);
    got = db ? rocksdb_get(db, ro, "small", 5, &len, &err) : NULL;
    CHECK(got && len == 5 && memcmp(got, "value", 5) == 0, "small value read back");
    rocksdb_free(got);
    if (db)
        rocksdb_close(db);
    rocksdb_readoptions_destroy(ro);
    rocksdb_flushoptions_destroy(fo);
    rocksdb_writeoptions_destroy(wo);
    rocksdb_options_destroy(o);
    free(v);
}

int main(void)
{
    char dir[] = "/tmp/kvd-crc32c-XXXXXX";
    if (!mkdtemp(dir)) {
        perror("mkdtemp");
        return 1;
    }
    uint64_t before = kvd__crc32c_calls();
    store_round_trip(dir);
    uint64_t calls = kvd__crc32c_calls() - before;
    CHECK(calls > 0, "RocksDB made no call to kvdepot's CRC32C");
    CHECK(strcmp(kvd_store_crc32c(), "isa-l") == 0, "kvd_store_crc32c() = %s", kvd_store_crc32c());
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0)
        fprintf(stderr, "could not remove %s\n", dir);

    /* kvdepot's function (what the process's lookup finds) and the
     * library's own. */
    extend_fn ours = (extend_fn)dlsym(RTLD_DEFAULT, EXTEND);
    Dl_info info;
    void *lib = NULL;
    if (dladdr((void *)rocksdb_open, &info) && info.dli_fname)
        lib = dlopen(info.dli_fname, RTLD_NOW | RTLD_NOLOAD);
    extend_fn theirs = lib ? (extend_fn)dlsym(lib, EXTEND) : NULL;
    CHECK(ours && theirs && ours != theirs, "functions: ours %p, RocksDB's %p", (void *)ours,
          (void *)theirs);
    if (!ours || !theirs || ours == theirs) {
        fprintf(stderr, "crc32c: %d failed\n", failures);
        return 1;
    }
    CHECK(ours(0, "123456789", 9) == 0xE3069283u, "check value %08x", ours(0, "123456789", 9));
    CHECK(theirs(0, "123456789", 9) == 0xE3069283u, "RocksDB's check value");
    enum { MAX = 200000 };
    char *buf = malloc(MAX + 16);
    for (size_t i = 0; i < MAX + 16; i++)
        buf[i] = (char)next();
    int compared = 0;
    for (size_t n = 0; n <= 300; n++) {
        uint32_t init = (uint32_t)next();
        const char *p = buf + (n % 16);
        CHECK(ours(init, p, n) == theirs(init, p, n), "n = %zu", n);
        compared++;
    }
    for (int i = 0; i < 200; i++) {
        size_t n = (size_t)(next() % MAX), off = (size_t)(next() % 16);
        uint32_t init = i % 2 ? (uint32_t)next() : 0;
        CHECK(ours(init, buf + off, n) == theirs(init, buf + off, n), "n = %zu at +%zu", n, off);
        size_t cut = n ? (size_t)(next() % n) : 0;
        CHECK(ours(ours(init, buf + off, cut), buf + off + cut, n - cut) ==
                  ours(init, buf + off, n),
              "in pieces at %zu of %zu", cut, n);
        compared++;
    }
    free(buf);
    dlclose(lib);
    if (failures) {
        fprintf(stderr, "crc32c: %d failed\n", failures);
        return 1;
    }
    printf("crc32c: RocksDB made %llu calls to kvdepot's CRC32C; %d comparisons with RocksDB's "
           "own passed\n",
           (unsigned long long)calls, compared);
    return 0;
}
