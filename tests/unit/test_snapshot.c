/*
 * Artifact snapshots on disk (store/seqcodec.h) and stored sizes across a
 * restart (store/sequence.c):
 *
 *  - sequences created with the same SVD codecs from the same artifacts
 *    store one shared snapshot ('z' hash) with a reference count ('y' hash)
 *    equal to the number of codec records naming it; every delete path
 *    (DeleteSequence, TTL expiry, the disk limit, model delete with force)
 *    releases the reference in the sequence's own batch, and the last one
 *    removes the snapshot; counts survive a restart and a kill -9;
 *  - recalibrated artifacts give a second snapshot; setting a sequence's
 *    codecs again moves its reference;
 *  - a sequence is created in one write with its codec record, snapshot
 *    reference, expiry and activation counts; a failed create (the write
 *    failing, a taken id, a bad argument) leaves none of them;
 *  - a data directory of the per-sequence form ('Z' id, codec record
 *    version 2) still opens, reads and deletes;
 *  - stored_bytes of coded sequences and the disk tier's bytes are the same
 *    after a restart as before it.
 *
 * The reference counts are checked against the codec records by reading
 * the closed store's RocksDB directly.
 */
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <rocksdb/c.h>
#define XXH_STATIC_LINKING_ONLY
#include <xxhash.h>

#include "artifact.h"
#include "kvdepot/quant.h"
#include "seqcodec.h"
#include "store.h"
#include "store_internal.h"

static int failures;

#define CHECK(cond, ...)                                                                           \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "%s:%d: check failed: %s: ", __FILE__, __LINE__, #cond);               \
            fprintf(stderr, __VA_ARGS__);                                                          \
            fputc('\n', stderr);                                                                   \
            failures++;                                                                            \
        }                                                                                          \
    } while (0)

#define REQUIRE(cond, ...)                                                                         \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "%s:%d: required check failed: %s: ", __FILE__, __LINE__, #cond);      \
            fprintf(stderr, __VA_ARGS__);                                                          \
            fputc('\n', stderr);                                                                   \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

#define B 16
#define L 2
#define H 2
#define D 32

static char dir[256];

static void make_dir(const char *name)
{
    const char *t = getenv("TMPDIR");
    snprintf(dir, sizeof dir, "%s/kvd_snapshot_%s_%d", t && t[0] ? t : "/tmp", name, (int)getpid());
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0)
        fprintf(stderr, "could not clean %s\n", dir);
}

static void rm_dir(void)
{
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0)
        fprintf(stderr, "could not remove %s\n", dir);
}

static kvd_store *open_store_opt(uint64_t disk_limit)
{
    kvd_store_options o = {.data_dir = dir, .page_tokens = B};
    if (disk_limit) {
        o.durability = KVD_DURABILITY_NONE;
        o.disk_bytes = disk_limit;
    }
    kvd_store *st;
    kvd_error err;
    REQUIRE(kvd_store_open(&o, &st, &err) == 0, "open %s: %s", dir, err.msg);
    return st;
}

static kvd_store *open_store(void)
{
    return open_store_opt(0);
}

/* Model `name` with SVD rotations (a permutation scaled by `salt`'s sign
 * pattern, orthogonal) and spectra for K and V of every layer and head. */
static void put_model_h(kvd_store *st, const char *name, int salt, uint32_t hidden_size)
{
    kvd_model_info m;
    memset(&m, 0, sizeof m);
    snprintf(m.name, sizeof m.name, "%s", name);
    m.hidden_size = hidden_size;
    snprintf(m.revision, sizeof m.revision, "r1");
    m.num_layers = L;
    m.num_kv_heads = H;
    m.num_q_heads = 2 * H;
    m.head_dim = D;
    m.dtype = KVD_DTYPE_F16;
    kvd_error err;
    int created;
    REQUIRE(kvd_store_model_put(st, &m, 0, NULL, &created, &err) == 0, "model: %s", err.msg);
    kvd_artifact a[4 * L * H];
    float *rot = calloc((size_t)D * D, sizeof *rot), spec[D];
    for (uint32_t i = 0; i < D; i++) {
        rot[(size_t)i * D + (i + (uint32_t)salt) % D] = (i + (uint32_t)salt) % 3 ? 1.0f : -1.0f;
        spec[i] = 1.0f / (float)(1u << (i < 20 ? i : 20)); /* energy in the first dims */
    }
    size_t n = 0;
    for (int kind = KVD_ARTIFACT_SVD_ROTATION_K; kind <= KVD_ARTIFACT_SVD_SPECTRUM_V; kind++)
        for (uint32_t l = 0; l < L; l++)
            for (uint32_t h = 0; h < H; h++) {
                int is_rot = kind <= KVD_ARTIFACT_SVD_ROTATION_V;
                a[n].kind = kind;
                a[n].layer = l;
                a[n].kv_head = h;
                a[n].ndim = is_rot ? 2 : 1;
                a[n].shape[0] = D;
                a[n].shape[1] = is_rot ? D : 0;
                a[n].data = is_rot ? rot : spec;
                n++;
            }
    REQUIRE(kvd_store_artifacts_put(st, name, a, n, &err) == 0, "artifacts: %s", err.msg);
    free(rot);
}

static void put_model(kvd_store *st, const char *name, int salt)
{
    put_model_h(st, name, salt, 0);
}

static kvd_seq_codecs svd_codecs(void)
{
    kvd_seq_codecs c;
    memset(&c, 0, sizeof c);
    c.k.codec = KVD_CODEC_RAW;
    c.k.svd = 1;
    c.k.svd_rate = 0.1;
    c.v = c.k;
    kvd_error err;
    REQUIRE(kvd_seq_codecs_check(&c, B, D, &err) == 0, "codecs: %s", err.msg);
    return c;
}

static void create(kvd_store *st, const char *id, const char *model, const kvd_seq_codecs *c)
{
    kvd_error err;
    kvd_seq_create_opts o = {.codecs = c};
    REQUIRE(kvd_store_seq_create_ex(st, id, strlen(id), model, NULL, 0, NULL, 0, &o, NULL,
                                    &err) == 0,
            "create %s: %s", id, err.msg);
}

static void del_seq(kvd_store *st, const char *id)
{
    kvd_error err;
    REQUIRE(kvd_store_seq_delete(st, id, strlen(id), NULL, &err) == 0, "delete %s: %s", id,
            err.msg);
}

/* Append tokens [0, n) of every layer: f16 values from a hash of salt. */
static void append(kvd_store *st, const char *id, int salt, uint64_t n)
{
    kvd_append_spec sp = {.seq_id = id,
                          .seq_id_len = strlen(id),
                          .layer_start = 0,
                          .num_layers = L,
                          .token_start = 0,
                          .num_tokens = n,
                          .dtype = KVD_DTYPE_F16};
    kvd_append *ap;
    uint64_t exp;
    kvd_error err;
    REQUIRE(kvd_store_append_begin(st, &sp, &ap, &exp, &err) == 0, "append %s: %s", id, err.msg);
    size_t cnt = 2 * (size_t)L * n * H * D;
    uint16_t *w = malloc(cnt * sizeof *w);
    uint64_t x = (uint64_t)salt * 0x9e3779b97f4a7c15ull + 1;
    for (size_t i = 0; i < cnt; i++) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        w[i] = kvd_f32_to_f16((float)(x & 0xffff) / 65536.0f * 4.0f - 2.0f);
    }
    REQUIRE(exp == cnt * 2, "expected %llu bytes", (unsigned long long)exp);
    REQUIRE(kvd_store_append_write(ap, w, cnt * 2, &err) == 0, "write: %s", err.msg);
    free(w);
    REQUIRE(kvd_store_append_commit(ap, NULL, &err) == 0, "commit %s: %s", id, err.msg);
}

/* ---- the closed store's RocksDB -------------------------------------------------------- */

static rocksdb_t *raw_open(rocksdb_options_t **o)
{
    *o = rocksdb_options_create();
    rocksdb_options_set_enable_blob_files(*o, 1);
    char *e = NULL;
    rocksdb_t *db = rocksdb_open(*o, dir, &e);
    REQUIRE(!e, "raw open: %s", e);
    return db;
}

static void raw_close(rocksdb_t *db, rocksdb_options_t *o)
{
    rocksdb_close(db);
    rocksdb_options_destroy(o);
}

static uint64_t be64(const uint8_t *p)
{
    uint64_t v = 0;
    for (int i = 0; i < 8; i++)
        v = v << 8 | p[i];
    return v;
}

static uint64_t le64(const uint8_t *p)
{
    uint64_t v = 0;
    for (int i = 0; i < 8; i++)
        v |= (uint64_t)p[i] << (8 * i);
    return v;
}

#define REC_HASH_OFF 46 /* codec record: u64 snapshot hash (seqcodec.h) */
#define REC_BYTES 54

typedef struct disk_state {
    size_t shared;       /* 'z' records */
    size_t own;          /* 'Z' records */
    uint64_t refs_total; /* sum of the 'y' counts */
    uint64_t shared_bytes, own_bytes;
    int consistent; /* every count equals the codec records naming its hash, and
                     * every 'z' has a count and the reverse, and hashes match */
} disk_state;

/* Check the snapshots and counts of the closed store in dir. */
static disk_state disk_check(void)
{
    disk_state ds = {0, 0, 0, 0, 0, 1};
    rocksdb_options_t *o;
    rocksdb_t *db = raw_open(&o);
    rocksdb_readoptions_t *ro = rocksdb_readoptions_create();
    uint64_t hashes[64], counts[64], named[64];
    size_t nh = 0;
    /* counts */
    rocksdb_iterator_t *it = rocksdb_create_iterator(db, ro);
    char p = 'y';
    for (rocksdb_iter_seek(it, &p, 1); rocksdb_iter_valid(it); rocksdb_iter_next(it)) {
        size_t kl, vl;
        const uint8_t *k = (const uint8_t *)rocksdb_iter_key(it, &kl);
        if (k[0] != 'y')
            break;
        const uint8_t *v = (const uint8_t *)rocksdb_iter_value(it, &vl);
        REQUIRE(kl == 9 && vl == 8 && nh < 64, "count record %zu/%zu", kl, vl);
        hashes[nh] = be64(k + 1);
        counts[nh] = le64(v);
        named[nh++] = 0;
        ds.refs_total += le64(v);
        if (!le64(v))
            ds.consistent = 0;
    }
    /* shared snapshots: one per count, bytes hashing to the key */
    size_t nz = 0;
    p = 'z';
    for (rocksdb_iter_seek(it, &p, 1); rocksdb_iter_valid(it); rocksdb_iter_next(it)) {
        size_t kl, vl;
        const uint8_t *k = (const uint8_t *)rocksdb_iter_key(it, &kl);
        if (k[0] != 'z')
            break;
        const char *v = rocksdb_iter_value(it, &vl);
        ds.shared++;
        ds.shared_bytes += vl;
        uint64_t h = be64(k + 1);
        int known = 0;
        for (size_t i = 0; i < nh; i++)
            known |= hashes[i] == h;
        if (kl != 9 || !known || XXH3_64bits(v, vl) != h)
            ds.consistent = 0;
        nz++;
    }
    if (nz != nh)
        ds.consistent = 0;
    p = 'Z';
    for (rocksdb_iter_seek(it, &p, 1); rocksdb_iter_valid(it); rocksdb_iter_next(it)) {
        size_t kl, vl;
        if (rocksdb_iter_key(it, &kl)[0] != 'Z')
            break;
        rocksdb_iter_value(it, &vl);
        ds.own++;
        ds.own_bytes += vl;
    }
    /* codec records of version 3 name shared snapshots */
    p = 'C';
    for (rocksdb_iter_seek(it, &p, 1); rocksdb_iter_valid(it); rocksdb_iter_next(it)) {
        size_t kl, vl;
        if (rocksdb_iter_key(it, &kl)[0] != 'C')
            break;
        const uint8_t *v = (const uint8_t *)rocksdb_iter_value(it, &vl);
        if (vl != REC_BYTES || v[0] != 3)
            continue;
        uint64_t h = le64(v + REC_HASH_OFF);
        size_t i = 0;
        while (i < nh && hashes[i] != h)
            i++;
        if (i == nh)
            ds.consistent = 0;
        else
            named[i]++;
    }
    for (size_t i = 0; i < nh; i++)
        if (named[i] != counts[i])
            ds.consistent = 0;
    rocksdb_iter_destroy(it);
    rocksdb_readoptions_destroy(ro);
    raw_close(db, o);
    return ds;
}

/* Load a sequence's snapshot the way Read and Attend do. */
static int load_arts(kvd_store *st, const char *id, int *shared)
{
    kvd_seq_codecs c;
    int found = 0;
    kvd_error err;
    int rc = kvd_store_seq_codecs_get(st, id, strlen(id), &c, &found, &err);
    if (!rc && !found)
        rc = KVD_ENOTFOUND;
    if (!rc)
        rc = kvd_seq_codecs_load_arts(st, id, strlen(id), &c, &err);
    if (!rc && !c.arts)
        rc = KVD_ECORRUPT;
    if (rc)
        fprintf(stderr, "load %s: %s\n", id, err.msg);
    *shared = c.arts_shared;
    kvd_seq_codecs_clear(&c);
    return rc;
}

/* ---- tests ------------------------------------------------------------------------------ */

/* 100 sequences, one snapshot; delete all but one, restart, the last. */
static void test_shared(void)
{
    make_dir("shared");
    kvd_store *st = open_store();
    put_model(st, "m", 1);
    kvd_seq_codecs c = svd_codecs();
    char id[16];
    for (int i = 0; i < 100; i++) {
        snprintf(id, sizeof id, "s%03d", i);
        create(st, id, "m", &c);
    }
    int shared = 0;
    CHECK(load_arts(st, "s042", &shared) == 0 && shared, "s042 reads the shared snapshot");
    append(st, "s007", 7, 2 * B + 3);
    kvd_store_close(st);
    disk_state ds = disk_check();
    printf("100 sequences: %zu shared snapshot(s) of %llu bytes, %zu own, %llu references\n",
           ds.shared, (unsigned long long)ds.shared_bytes, ds.own,
           (unsigned long long)ds.refs_total);
    CHECK(ds.shared == 1 && ds.own == 0 && ds.refs_total == 100 && ds.consistent,
          "100 sequences: %zu shared, %zu own, %llu refs", ds.shared, ds.own,
          (unsigned long long)ds.refs_total);

    st = open_store();
    for (int i = 0; i < 99; i++) {
        snprintf(id, sizeof id, "s%03d", i);
        del_seq(st, id);
    }
    CHECK(load_arts(st, "s099", &shared) == 0 && shared, "s099 after 99 deletes");
    kvd_store_close(st);
    ds = disk_check();
    CHECK(ds.shared == 1 && ds.refs_total == 1 && ds.consistent, "one left: %zu, %llu refs",
          ds.shared, (unsigned long long)ds.refs_total);

    st = open_store(); /* restart: the count is read from disk */
    del_seq(st, "s099");
    kvd_store_close(st);
    ds = disk_check();
    CHECK(ds.shared == 0 && ds.own == 0 && ds.refs_total == 0 && ds.consistent,
          "all deleted: %zu shared, %llu refs", ds.shared, (unsigned long long)ds.refs_total);
    rm_dir();
}

/* Other artifacts, codecs set again, raw codecs, and every delete path. */
static void test_paths(void)
{
    make_dir("paths");
    kvd_store *st = open_store_opt(1ull << 40);
    put_model(st, "m", 1);
    put_model(st, "m2", 2);
    kvd_seq_codecs c = svd_codecs(), raw;
    memset(&raw, 0, sizeof raw);
    create(st, "a", "m", &c);
    create(st, "b", "m", &c);
    create(st, "c", "m2", &c); /* other artifacts: a second snapshot */
    create(st, "d", "m2", &c);
    create(st, "e", "m2", &c);
    create(st, "r", "m", &raw);
    kvd_error err;
    /* Set again: same snapshot keeps one reference; raw drops it. */
    REQUIRE(kvd_store_seq_codecs_set(st, "a", 1, &c, &err) == 0, "again: %s", err.msg);
    REQUIRE(kvd_store_seq_codecs_set(st, "b", 1, &raw, &err) == 0, "raw: %s", err.msg);
    CHECK(kvd_store_seq_codecs_set(st, "nope", 4, &c, &err) == KVD_ENOTFOUND, "unknown id");
    /* Recalibrating m changes nothing for a: its snapshot stays. */
    put_model(st, "m", 5);
    create(st, "f", "m", &c); /* a third snapshot */
    kvd_store_close(st);
    disk_state ds = disk_check();
    CHECK(ds.shared == 3 && ds.refs_total == 5 && ds.own == 0 && ds.consistent,
          "3 snapshots: %zu, %llu refs", ds.shared, (unsigned long long)ds.refs_total);

    st = open_store_opt(1ull << 40);
    int shared;
    CHECK(load_arts(st, "a", &shared) == 0 && shared, "a");
    /* TTL expiry */
    REQUIRE(kvd_store_seq_set_ttl(st, "c", 1, 1, &err) == 0, "ttl: %s", err.msg);
    usleep(20000);
    kvd__expire(st);
    kvd_seq_info info;
    CHECK(kvd_store_seq_stat(st, "c", 1, &info, &err) == KVD_ENOTFOUND, "c expired");
    /* Model delete with force: d and e (m2's snapshot goes with them). */
    uint64_t ndel = 0;
    CHECK(kvd_store_model_delete(st, "m2", 1, &ndel, &err) == 0 && ndel == 2, "m2: %s", err.msg);
    kvd_store_close(st);
    ds = disk_check();
    CHECK(ds.shared == 2 && ds.refs_total == 2 && ds.consistent, "after m2: %zu, %llu refs",
          ds.shared, (unsigned long long)ds.refs_total);

    /* The disk limit drops every sequence (nothing fits the room asked). */
    st = open_store_opt(1ull << 20);
    kvd__disk_make_room(st, NULL, 1ull << 30);
    kvd_store_stats ss;
    kvd_store_stats_get(st, &ss);
    CHECK(ss.sequences == 0 && ss.sequences_dropped == 4, "dropped %llu, left %llu",
          (unsigned long long)ss.sequences_dropped, (unsigned long long)ss.sequences);
    kvd_store_close(st);
    ds = disk_check();
    CHECK(ds.shared == 0 && ds.refs_total == 0 && ds.own == 0 && ds.consistent,
          "after drops: %zu, %llu refs", ds.shared, (unsigned long long)ds.refs_total);
    rm_dir();
}

/* A sequence record of version 1 (page ids without sizes) from one of
 * version 2: same fields, each page's u64 size left out. */
static size_t seq_record_v1(const uint8_t *v, size_t n, uint8_t *out)
{
    size_t i = 0, o = 0;
#define COPY(k)                                                                                    \
    do {                                                                                           \
        REQUIRE(i + (k) <= n, "record short");                                                     \
        memcpy(out + o, v + i, (k));                                                               \
        i += (k);                                                                                  \
        o += (k);                                                                                  \
    } while (0)
    REQUIRE(v[0] == 2, "record version %u", v[0]);
    COPY(2);
    COPY(v[1]);  /* model name */
    COPY(8 + 8); /* created, prefix_blocks */
    uint32_t nl = (uint32_t)le64((const uint8_t[8]){v[i], v[i + 1], v[i + 2], v[i + 3]});
    COPY(4);
    uint64_t nh = le64(v + i);
    COPY(8);
    COPY(nh * 8);
    uint64_t ni = le64(v + i);
    COPY(8);
    COPY(ni * 4);
    for (uint32_t l = 0; l < nl; l++) {
        COPY(8);
        uint32_t np = (uint32_t)le64((const uint8_t[8]){v[i], v[i + 1], v[i + 2], v[i + 3]});
        COPY(4);
        for (uint32_t p = 0; p < np; p++) {
            COPY(8);
            i += 8; /* the size */
        }
    }
#undef COPY
    REQUIRE(i == n, "record of %zu bytes, parsed %zu", n, i);
    out[0] = 1;
    return o;
}

/* A store written before snapshots were shared and page sizes recorded:
 * 'Z' id, version 2 codec records, version 1 sequence records. Built from
 * a new one by rewriting its records. */
static void test_old_form(void)
{
    make_dir("old");
    kvd_store *st = open_store();
    put_model(st, "m", 9); /* artifacts no other test loads: no cached copy */
    kvd_seq_codecs c = svd_codecs();
    create(st, "old", "m", &c);
    create(st, "old2", "m", &c);
    append(st, "old", 3, 3 * B);
    kvd_store_close(st);

    rocksdb_options_t *o;
    rocksdb_t *db = raw_open(&o);
    rocksdb_readoptions_t *ro = rocksdb_readoptions_create();
    rocksdb_writeoptions_t *wo = rocksdb_writeoptions_create();
    rocksdb_writebatch_t *b = rocksdb_writebatch_create();
    char *e = NULL;
    size_t rl = 0, zl = 0;
    char *rec = rocksdb_get(db, ro, "Cold", 4, &rl, &e);
    REQUIRE(rec && rl == REC_BYTES && rec[0] == 3, "codec record");
    uint64_t h = le64((const uint8_t *)rec + REC_HASH_OFF);
    uint8_t zk[9] = {'z'}, yk[9] = {'y'};
    for (int i = 0; i < 8; i++)
        zk[1 + i] = yk[1 + i] = (uint8_t)(h >> (56 - 8 * i));
    char *snap = rocksdb_get(db, ro, (const char *)zk, 9, &zl, &e);
    REQUIRE(snap && !e, "snapshot");
    rec[0] = 2;
    rocksdb_writebatch_put(b, "Cold", 4, rec, rl);
    rocksdb_writebatch_put(b, "Zold", 4, snap, zl);
    rocksdb_writebatch_put(b, "Cold2", 5, rec, REC_BYTES - 8); /* version 2 without the hash */
    rocksdb_writebatch_put(b, "Zold2", 5, snap, zl);
    rocksdb_writebatch_delete(b, (const char *)zk, 9);
    rocksdb_writebatch_delete(b, (const char *)yk, 9);
    const char *seqs[] = {"Sold", "Sold2"};
    for (int i = 0; i < 2; i++) {
        size_t sl = 0;
        char *sr = rocksdb_get(db, ro, seqs[i], strlen(seqs[i]), &sl, &e);
        REQUIRE(sr && !e, "sequence record");
        uint8_t *v1 = malloc(sl);
        size_t n1 = seq_record_v1((const uint8_t *)sr, sl, v1);
        REQUIRE(n1 < sl || i == 1, "version 1 record is shorter");
        rocksdb_writebatch_put(b, seqs[i], strlen(seqs[i]), (const char *)v1, n1);
        free(v1);
        free(sr);
    }
    rocksdb_write(db, wo, b, &e);
    REQUIRE(!e, "rewrite: %s", e);
    free(rec);
    free(snap);
    rocksdb_writebatch_destroy(b);
    rocksdb_writeoptions_destroy(wo);
    rocksdb_readoptions_destroy(ro);
    raw_close(db, o);
    disk_state ds = disk_check();
    REQUIRE(ds.shared == 0 && ds.own == 2 && ds.consistent, "old form: %zu own", ds.own);

    st = open_store();
    kvd_seq_info info;
    kvd_error err;
    REQUIRE(kvd_store_seq_stat(st, "old", 3, &info, &err) == 0, "stat old: %s", err.msg);
    CHECK(info.num_tokens == 3 * B && info.sealed_pages == 3 * L && info.stored_bytes > 0,
          "old: %llu tokens", (unsigned long long)info.num_tokens);
    kvd_seq_info_clear(&info);
    int shared = 1;
    CHECK(load_arts(st, "old", &shared) == 0 && !shared, "old reads its own snapshot");
    shared = 1;
    CHECK(load_arts(st, "old2", &shared) == 0 && !shared, "old2 (no hash) reads its own");
    kvd_read_spec rs = {.seq_id = "old",
                        .seq_id_len = 3,
                        .layer_start = 0,
                        .num_layers = L,
                        .token_start = 0,
                        .num_tokens = 3 * B};
    kvd_read *rd = NULL;
    kvd_read_shape shape;
    CHECK(kvd_store_read_begin(st, &rs, &rd, &shape, &err) == 0, "read old: %s", err.msg);
    if (rd) {
        uint8_t *buf = malloc(1 << 16);
        size_t got = 0;
        uint64_t total = 0;
        int rc;
        while ((rc = kvd_store_read_next(rd, buf, 1 << 16, &got, &err)) == 0 && got)
            total += got;
        CHECK(rc == 0 && total == shape.total_bytes, "read old pages: %llu of %llu: %s",
              (unsigned long long)total, (unsigned long long)shape.total_bytes, err.msg);
        free(buf);
        kvd_store_read_end(rd);
    }
    create(st, "new", "m", &c); /* shared, beside the old ones */
    del_seq(st, "old");
    kvd_store_close(st);
    ds = disk_check();
    CHECK(ds.shared == 1 && ds.own == 1 && ds.refs_total == 1 && ds.consistent,
          "mixed: %zu shared, %zu own", ds.shared, ds.own);
    st = open_store();
    del_seq(st, "old2");
    del_seq(st, "new");
    kvd_store_close(st);
    ds = disk_check();
    CHECK(ds.shared == 0 && ds.own == 0 && ds.refs_total == 0 && ds.consistent, "all gone");
    rm_dir();
}

/* A stored snapshot with the hash of a new one but other bytes (an XXH3
 * collision, made by damaging the stored one): the new sequence keeps its
 * own copy and the stored one is left alone. */
static void test_collision(void)
{
    make_dir("collision");
    kvd_store *st = open_store();
    put_model(st, "m", 11);
    kvd_seq_codecs c = svd_codecs();
    create(st, "a", "m", &c);
    kvd_store_close(st);

    rocksdb_options_t *o;
    rocksdb_t *db = raw_open(&o);
    rocksdb_readoptions_t *ro = rocksdb_readoptions_create();
    rocksdb_writeoptions_t *wo = rocksdb_writeoptions_create();
    char *e = NULL;
    size_t rl = 0, zl = 0;
    char *rec = rocksdb_get(db, ro, "Ca", 2, &rl, &e);
    REQUIRE(rec && rl == REC_BYTES && rec[0] == 3, "codec record");
    uint8_t zk[9] = {'z'};
    uint64_t h = le64((const uint8_t *)rec + REC_HASH_OFF);
    for (int i = 0; i < 8; i++)
        zk[1 + i] = (uint8_t)(h >> (56 - 8 * i));
    char *snap = rocksdb_get(db, ro, (const char *)zk, 9, &zl, &e);
    REQUIRE(snap && zl > 100, "snapshot");
    snap[zl - 1] ^= 1;
    rocksdb_put(db, wo, (const char *)zk, 9, snap, zl, &e);
    REQUIRE(!e, "put: %s", e);
    free(rec);
    rocksdb_writeoptions_destroy(wo);
    rocksdb_readoptions_destroy(ro);
    raw_close(db, o);

    st = open_store();
    create(st, "b", "m", &c);
    int shared = 1;
    CHECK(load_arts(st, "b", &shared) == 0 && !shared, "b keeps its own snapshot");
    CHECK(load_arts(st, "a", &shared) == KVD_ECORRUPT, "a's damaged snapshot is refused");
    kvd_store_close(st);
    disk_state ds = disk_check();
    CHECK(ds.shared == 1 && ds.own == 1 && ds.refs_total == 1 && ds.own_bytes == zl,
          "collision: %zu shared, %zu own, %llu refs", ds.shared, ds.own,
          (unsigned long long)ds.refs_total);
    st = open_store();
    del_seq(st, "b");
    kvd_store_close(st);
    ds = disk_check();
    CHECK(ds.shared == 1 && ds.own == 0 && ds.refs_total == 1, "b deleted: %zu shared, %zu own",
          ds.shared, ds.own);
    st = open_store();
    del_seq(st, "a");
    kvd_store_close(st);
    ds = disk_check();
    CHECK(ds.shared == 0 && ds.own == 0 && ds.refs_total == 0 && ds.consistent, "all deleted");
    free(snap);
    rm_dir();
}

/* kill -9 after creates and deletes: the counts equal the records. */
static void crash_child(const char *d)
{
    snprintf(dir, sizeof dir, "%s", d);
    kvd_store *st = open_store();
    put_model(st, "m", 1);
    kvd_seq_codecs c = svd_codecs();
    char id[16];
    for (int i = 0; i < 10; i++) {
        snprintf(id, sizeof id, "k%d", i);
        create(st, id, "m", &c);
    }
    for (int i = 0; i < 4; i++) {
        snprintf(id, sizeof id, "k%d", i);
        del_seq(st, id);
    }
    kill(getpid(), SIGKILL);
    _exit(4);
}

static void test_crash(void)
{
    make_dir("crash");
    pid_t pid = fork();
    REQUIRE(pid >= 0, "fork");
    if (pid == 0) {
        execl("/proc/self/exe", "test_snapshot", "crash-child", dir, (char *)NULL);
        _exit(5);
    }
    int status = 0;
    waitpid(pid, &status, 0);
    CHECK(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL, "child status %d", status);
    disk_state ds = disk_check();
    CHECK(ds.shared == 1 && ds.refs_total == 6 && ds.consistent, "after kill: %zu, %llu refs",
          ds.shared, (unsigned long long)ds.refs_total);
    kvd_store *st = open_store();
    kvd_store_stats ss;
    kvd_store_stats_get(st, &ss);
    CHECK(ss.sequences == 6, "%llu sequences", (unsigned long long)ss.sequences);
    char id[16];
    for (int i = 4; i < 10; i++) {
        snprintf(id, sizeof id, "k%d", i);
        del_seq(st, id);
    }
    kvd_store_close(st);
    ds = disk_check();
    CHECK(ds.shared == 0 && ds.refs_total == 0 && ds.consistent, "all deleted after kill");
    rm_dir();
}

/* Threads creating and deleting sequences that share one snapshot. */
typedef struct worker {
    kvd_store *st;
    int t;
} worker;

static void *work(void *arg)
{
    worker *w = arg;
    kvd_seq_codecs c = svd_codecs();
    char id[16];
    for (int round = 0; round < 3; round++) {
        for (int i = 0; i < 10; i++) {
            snprintf(id, sizeof id, "t%d-%d", w->t, i);
            create(w->st, id, "m", &c);
        }
        for (int i = 0; i < 10; i += 1 + (round < 2)) { /* the last round deletes all */
            snprintf(id, sizeof id, "t%d-%d", w->t, i);
            del_seq(w->st, id);
        }
        if (round < 2)
            for (int i = 1; i < 10; i += 2) {
                snprintf(id, sizeof id, "t%d-%d", w->t, i);
                del_seq(w->st, id);
            }
    }
    return NULL;
}

static void test_concurrent(void)
{
    make_dir("threads");
    kvd_store *st = open_store();
    put_model(st, "m", 1);
    kvd_seq_codecs c = svd_codecs();
    create(st, "keep", "m", &c);
    worker w[4];
    pthread_t th[4];
    for (int t = 0; t < 4; t++) {
        w[t] = (worker){st, t};
        REQUIRE(pthread_create(&th[t], NULL, work, &w[t]) == 0, "thread");
    }
    for (int t = 0; t < 4; t++)
        pthread_join(th[t], NULL);
    kvd_store_close(st);
    disk_state ds = disk_check();
    CHECK(ds.shared == 1 && ds.refs_total == 1 && ds.consistent, "threads: %zu, %llu refs",
          ds.shared, (unsigned long long)ds.refs_total);
    rm_dir();
}

/* stored_bytes and the disk tier's bytes of coded sequences (SVD, INT4,
 * a prefix sharer, a partial tail page) equal before and after a restart. */
static void test_stored_bytes(void)
{
    make_dir("bytes");
    kvd_store *st = open_store();
    put_model(st, "m", 1);
    kvd_seq_codecs c = svd_codecs(), i4;
    memset(&i4, 0, sizeof i4);
    i4.k.codec = i4.v.codec = KVD_CODEC_INT4;
    i4.k.group = i4.v.group = 32;
    kvd_error err;
    REQUIRE(kvd_seq_codecs_check(&i4, B, D, &err) == 0, "int4: %s", err.msg);
    create(st, "svd", "m", &c);
    create(st, "int4", "m", &i4);
    create(st, "raw", "m", &(kvd_seq_codecs){0});
    append(st, "svd", 1, 4 * B + 5);
    append(st, "int4", 2, 3 * B);
    append(st, "raw", 3, 4 * B + 5);
    const char *ids[] = {"svd", "int4", "raw"};
    uint64_t before[3];
    kvd_seq_info info;
    for (int i = 0; i < 3; i++) {
        REQUIRE(kvd_store_seq_stat(st, ids[i], strlen(ids[i]), &info, &err) == 0, "stat: %s",
                err.msg);
        before[i] = info.stored_bytes;
        kvd_seq_info_clear(&info);
    }
    printf("stored bytes: svd %llu, int4 %llu, raw %llu\n", (unsigned long long)before[0],
           (unsigned long long)before[1], (unsigned long long)before[2]);
    kvd_store_stats s0, s1;
    kvd_store_stats_get(st, &s0);
    kvd_store_close(st);

    st = open_store();
    for (int i = 0; i < 3; i++) {
        REQUIRE(kvd_store_seq_stat(st, ids[i], strlen(ids[i]), &info, &err) == 0, "stat: %s",
                err.msg);
        CHECK(info.stored_bytes == before[i], "%s: %llu bytes after restart, %llu before", ids[i],
              (unsigned long long)info.stored_bytes, (unsigned long long)before[i]);
        kvd_seq_info_clear(&info);
    }
    kvd_store_stats_get(st, &s1);
    CHECK(s1.tier_bytes[KVD_TIER_DISK] == s0.tier_bytes[KVD_TIER_DISK] &&
              s1.tier_pages[KVD_TIER_DISK] == s0.tier_pages[KVD_TIER_DISK],
          "disk tier: %llu bytes after, %llu before",
          (unsigned long long)s1.tier_bytes[KVD_TIER_DISK],
          (unsigned long long)s0.tier_bytes[KVD_TIER_DISK]);
    /* Coded pages are smaller than raw: the check above means something. */
    CHECK(before[0] < before[2], "svd %llu vs raw %llu", (unsigned long long)before[0],
          (unsigned long long)before[2]);
    kvd_store_close(st);
    rm_dir();
}

/* The value of key kind ‖ id in the closed store (malloc'd, NULL if absent). */
static char *raw_get(char kind, const char *id, size_t *len)
{
    rocksdb_options_t *o;
    rocksdb_t *db = raw_open(&o);
    rocksdb_readoptions_t *ro = rocksdb_readoptions_create();
    char key[64];
    key[0] = kind;
    size_t n = strlen(id);
    memcpy(key + 1, id, n);
    char *e = NULL;
    char *v = rocksdb_get(db, ro, key, n + 1, len, &e);
    REQUIRE(!e, "raw get: %s", e);
    rocksdb_readoptions_destroy(ro);
    raw_close(db, o);
    return v;
}

/* Which of a sequence's records the closed store holds: 'S' sequence, 'C'
 * codecs, 'X' expiry, 'a' activation counts (a bit each). */
static int records(const char *id)
{
    static const char kinds[] = "SCXa";
    int r = 0;
    for (int i = 0; kinds[i]; i++) {
        size_t len = 0;
        char *v = raw_get(kinds[i], id, &len);
        r |= v ? 1 << i : 0;
        free(v);
    }
    return r;
}

/* CreateSequence's one write: the sequence record, its codec record with the
 * snapshot reference, its expiry and activation counts, or nothing. */
static void test_create_atomic(void)
{
    make_dir("atomic");
    kvd_store *st = open_store();
    put_model_h(st, "m", 1, 2 * D);
    put_model(st, "nohidden", 1);
    kvd_seq_codecs c = svd_codecs(), raw;
    memset(&raw, 0, sizeof raw);
    kvd_error err;
    kvd_seq_create_opts o = {.codecs = &c, .ttl_ms = 3600 * 1000, .store_activations = 1};
    uint64_t w0 = atomic_load(&kvd__db_writes);
    CHECK(kvd_store_seq_create_ex(st, "a", 1, "m", NULL, 0, NULL, 0, &o, NULL, &err) == 0,
          "create a: %s", err.msg);
    CHECK(atomic_load(&kvd__db_writes) == w0 + 1, "create a: %llu writes, want 1",
          (unsigned long long)(atomic_load(&kvd__db_writes) - w0));
    /* The write fails: nothing visible, no reference, the counts unlocked. */
    atomic_store(&kvd__fault_db_write, 1);
    CHECK(kvd_store_seq_create_ex(st, "b", 1, "m", NULL, 0, NULL, 0, &o, NULL, &err) ==
              KVD_EINTERNAL,
          "create b with a failing write");
    atomic_store(&kvd__fault_db_write, 0);
    kvd_seq_info info;
    CHECK(kvd_store_seq_stat(st, "b", 1, &info, &err) == KVD_ENOTFOUND, "b after a failed write");
    /* Failures before the write: a taken id, a model without hidden_size,
     * activations with a prefix, an unknown model. */
    CHECK(kvd_store_seq_create_ex(st, "a", 1, "m", NULL, 0, NULL, 0, &o, NULL, &err) ==
              KVD_EEXIST,
          "a again");
    CHECK(kvd_store_seq_create_ex(st, "c", 1, "nohidden", NULL, 0, NULL, 0, &o, NULL, &err) ==
              KVD_EPRECOND,
          "activations without hidden_size");
    uint64_t h = 1;
    CHECK(kvd_store_seq_create_ex(st, "c", 1, "m", &h, 1, NULL, 0, &o, NULL, &err) == KVD_EINVAL,
          "activations with a prefix");
    CHECK(kvd_store_seq_create_ex(st, "c", 1, "zz", NULL, 0, NULL, 0, &o, NULL, &err) ==
              KVD_ENOTFOUND,
          "unknown model");
    /* The id of the failed write is free, and the counts were unlocked. */
    kvd_seq_create_opts ob = {.codecs = &c};
    CHECK(kvd_store_seq_create_ex(st, "b", 1, "m", NULL, 0, NULL, 0, &ob, NULL, &err) == 0,
          "create b: %s", err.msg);
    kvd_seq_create_opts oraw = {.codecs = &raw};
    CHECK(kvd_store_seq_create_ex(st, "r", 1, "m", NULL, 0, NULL, 0, &oraw, NULL, &err) == 0,
          "create r: %s", err.msg);
    kvd_store_close(st);

    CHECK(records("a") == 0xf, "a: records %#x, want S C X a", records("a"));
    CHECK(records("b") == 0x3, "b: records %#x, want S C", records("b"));
    CHECK(records("r") == 0x3, "r: records %#x, want S C (raw codecs)", records("r"));
    CHECK(records("c") == 0, "c: records %#x, want none", records("c"));
    disk_state ds = disk_check();
    CHECK(ds.shared == 1 && ds.refs_total == 2 && ds.own == 0 && ds.consistent,
          "after failed creates: %zu snapshots, %llu refs", ds.shared,
          (unsigned long long)ds.refs_total);

    /* After a restart: a stores coded pages with its TTL and activations. */
    st = open_store();
    int shared = 0;
    CHECK(load_arts(st, "a", &shared) == 0 && shared, "a's snapshot after a restart");
    CHECK(kvd_store_seq_stat(st, "a", 1, &info, &err) == 0, "stat a: %s", err.msg);
    kvd_seq_info_clear(&info);
    del_seq(st, "a");
    del_seq(st, "b");
    del_seq(st, "r");
    kvd_store_close(st);
    ds = disk_check();
    CHECK(ds.shared == 0 && ds.refs_total == 0 && ds.consistent, "all deleted");
    rm_dir();
}

int main(int argc, char **argv)
{
    if (argc == 3 && strcmp(argv[1], "crash-child") == 0)
        crash_child(argv[2]);
    test_shared();
    test_paths();
    test_old_form();
    test_collision();
    test_crash();
    test_concurrent();
    test_stored_bytes();
    test_create_atomic();
    if (failures) {
        fprintf(stderr, "%d check(s) failed\n", failures);
        return 1;
    }
    printf("ok\n");
    return 0;
}
