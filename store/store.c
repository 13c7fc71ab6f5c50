/*
 * kvd_store: opening, closing and recovering the RocksDB database, plus the
 * small u64 map the store's indexes use.
 */
#include "pqindex.h"
#include "store_internal.h"

#include <dirent.h>
#include <errno.h>
#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* The streaming state lives on the stack; its layout is in the header. */
#define XXH_STATIC_LINKING_ONLY
#include <xxhash.h>

#define META_VERSION KVD_STORE_FORMAT

uint64_t kvd__now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

void kvd__page_key(uint8_t key[KVD__PAGE_KEY_LEN], uint64_t id)
{
    /* Big-endian so pages sort by id in RocksDB. */
    key[0] = KVD__KEY_PAGE;
    for (int i = 0; i < 8; i++)
        key[1 + i] = (uint8_t)(id >> (56 - 8 * i));
}

uint64_t kvd_prefix_hash(uint64_t parent, const uint32_t *token_ids, size_t n)
{
    /* The hash is defined over little-endian u32 ids; convert in chunks so a
     * big-endian host computes the same value. */
    XXH3_state_t s;
    uint8_t buf[1024];
    XXH3_64bits_reset_withSeed(&s, parent);
    size_t i = 0;
    while (i < n) {
        size_t k = 0;
        for (; i < n && k + 4 <= sizeof buf; i++, k += 4) {
            uint32_t t = token_ids[i];
            buf[k] = (uint8_t)t;
            buf[k + 1] = (uint8_t)(t >> 8);
            buf[k + 2] = (uint8_t)(t >> 16);
            buf[k + 3] = (uint8_t)(t >> 24);
        }
        XXH3_64bits_update(&s, buf, k);
    }
    return XXH3_64bits_digest(&s);
}

uint32_t kvd_store_page_tokens(const kvd_store *st)
{
    return st->page_tokens;
}

kvd_backend *kvd_store_backend(kvd_store *st)
{
    return st->be;
}

const char *kvd_store_recovery_report(const kvd_store *st) { return st->recovery_report; }

const char *kvd_store_broken(kvd_store *st)
{
    return atomic_load(&st->broken) ? st->broken_why : NULL;
}

rocksdb_iterator_t *kvd__scan_open(kvd_store *st, kvd__scan *sc, const void *prefix, size_t plen)
{
    size_t n = plen < sizeof sc->upper ? plen : sizeof sc->upper;
    memcpy(sc->upper, prefix, n);
    while (n > 0 && (unsigned char)sc->upper[n - 1] == 0xff)
        n--; /* the next prefix: carry */
    sc->ro = rocksdb_readoptions_create();
    if (n > 0) {
        sc->upper[n - 1]++;
        rocksdb_readoptions_set_iterate_upper_bound(sc->ro, sc->upper, n);
    }
    sc->it = rocksdb_create_iterator(st->db, sc->ro);
    return sc->it;
}

void kvd__scan_close(kvd__scan *sc)
{
    rocksdb_iter_destroy(sc->it);
    rocksdb_readoptions_destroy(sc->ro);
}

kvd_backend *kvd_store_coding_backend(kvd_store *st)
{
    return &st->be_coding;
}

kvd_backend *kvd_store_device_opened(kvd_store *st)
{
    return st->dev;
}

kvd_backend *kvd_store_device(kvd_store *st)
{
    return atomic_load(&st->dev_lost) ? NULL : st->dev;
}

/* ---- u64 -> pointer map (linear probing; key 0 is stored like any other,
 * emptiness is a NULL value) ------------------------------------------- */

static size_t map_slot(uint64_t key, size_t cap)
{
    key ^= key >> 33;
    key *= 0xff51afd7ed558ccdull;
    key ^= key >> 33;
    return (size_t)key & (cap - 1);
}

void *kvd__map_get(const kvd__map *m, uint64_t key)
{
    if (m->cap == 0)
        return NULL;
    for (size_t i = map_slot(key, m->cap);; i = (i + 1) & (m->cap - 1)) {
        if (!m->vals[i])
            return NULL;
        if (m->keys[i] == key)
            return m->vals[i];
    }
}

static int map_grow(kvd__map *m)
{
    size_t ncap = m->cap ? m->cap * 2 : 16;
    uint64_t *nk = calloc(ncap, sizeof *nk);
    void **nv = calloc(ncap, sizeof *nv);
    if (!nk || !nv) {
        free(nk);
        free(nv);
        return KVD_ENOMEM;
    }
    for (size_t i = 0; i < m->cap; i++) {
        if (!m->vals[i])
            continue;
        size_t j = map_slot(m->keys[i], ncap);
        while (nv[j])
            j = (j + 1) & (ncap - 1);
        nk[j] = m->keys[i];
        nv[j] = m->vals[i];
    }
    free(m->keys);
    free(m->vals);
    m->keys = nk;
    m->vals = nv;
    m->cap = ncap;
    return 0;
}

int kvd__map_put(kvd__map *m, uint64_t key, void *val)
{
    if ((m->n + 1) * 4 > m->cap * 3 && map_grow(m))
        return KVD_ENOMEM;
    size_t i = map_slot(key, m->cap);
    while (m->vals[i] && m->keys[i] != key)
        i = (i + 1) & (m->cap - 1);
    if (!m->vals[i])
        m->n++;
    m->keys[i] = key;
    m->vals[i] = val;
    return 0;
}

void kvd__map_del(kvd__map *m, uint64_t key)
{
    if (m->cap == 0)
        return;
    size_t i = map_slot(key, m->cap);
    while (m->vals[i] && m->keys[i] != key)
        i = (i + 1) & (m->cap - 1);
    if (!m->vals[i])
        return;
    m->vals[i] = NULL;
    m->n--;
    /* Re-insert the rest of the probe run so look-ups never stop early. */
    for (size_t j = (i + 1) & (m->cap - 1); m->vals[j]; j = (j + 1) & (m->cap - 1)) {
        uint64_t k = m->keys[j];
        void *v = m->vals[j];
        m->vals[j] = NULL;
        size_t s = map_slot(k, m->cap);
        while (m->vals[s])
            s = (s + 1) & (m->cap - 1);
        m->keys[s] = k;
        m->vals[s] = v;
    }
}

void kvd__map_free(kvd__map *m)
{
    free(m->keys);
    free(m->vals);
    memset(m, 0, sizeof *m);
}

/* ---- RocksDB ------------------------------------------------------------ */

_Atomic int kvd__fault_db_write;
_Atomic uint64_t kvd__db_writes;

int kvd__db_write(kvd_store *st, rocksdb_writebatch_t *b, kvd_error *err)
{
    int n = atomic_load(&kvd__fault_db_write);
    while (n > 0 && !atomic_compare_exchange_weak(&kvd__fault_db_write, &n, n - 1))
        ;
    if (n > 0)
        return kvd_error_set(err, KVD_EINTERNAL, "rocksdb write failed: injected fault");
    char *e = NULL;
    rocksdb_write(st->db, st->wopt, b, &e);
    if (e) {
        kvd_error_set(err, KVD_EINTERNAL, "rocksdb write failed: %s", e);
        /* An I/O error (a failed flush: no descriptor, no space) stops
         * every later write of this open: the store is broken until a
         * restart recovers it from the WAL. */
        if (strncmp(e, "IO error", 8) == 0 && !atomic_exchange(&st->broken_claim, 1)) {
            snprintf(st->broken_why, sizeof st->broken_why, "%s", e);
            atomic_store(&st->broken, 1);
        }
        rocksdb_free(e);
        return KVD_EINTERNAL;
    }
    atomic_fetch_add(&kvd__db_writes, 1);
    return 0;
}

/*
 * What RocksDB's log of this open (dir/LOG, started afresh at every open)
 * says it dropped from damaged WAL files: "FILE: dropping N bytes; REASON"
 * lines, joined with "; " into out. 1 when there was one, else 0.
 */
static int wal_damage(const char *dir, char *out, size_t cap)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/LOG", dir);
    FILE *f = fopen(path, "r");
    out[0] = '\0';
    if (!f)
        return 0;
    char line[1024];
    size_t used = 0;
    int found = 0;
    while (fgets(line, sizeof line, f)) {
        char *d = strstr(line, ".log: dropping ");
        if (!d)
            continue;
        char *start = d;
        while (start > line && start[-1] != ' ')
            start--;
        line[strcspn(line, "\n")] = '\0';
        int n = snprintf(out + used, cap - used, "%s%s", found ? "; " : "", start);
        if (n < 0 || (size_t)n >= cap - used)
            break;
        used += (size_t)n;
        found = 1;
    }
    fclose(f);
    return found;
}

static int mkdir_p(const char *path, kvd_error *err)
{
    char *tmp = strdup(path);
    if (!tmp)
        return kvd_error_set(err, KVD_ENOMEM, "out of memory");
    for (char *p = tmp + 1;; p++) {
        if (*p == '/' || *p == '\0') {
            char c = *p;
            *p = '\0';
            if (mkdir(tmp, 0700) != 0 && errno != EEXIST) {
                int e = errno;
                kvd_error_set(err, KVD_EINTERNAL, "cannot create directory %s: %s", tmp,
                              strerror(e));
                free(tmp);
                return KVD_EINTERNAL;
            }
            *p = c;
            if (c == '\0')
                break;
        }
    }
    free(tmp);
    return 0;
}

/* RocksDB's options of every store (and of its repair). */
static rocksdb_options_t *db_options(void)
{
    rocksdb_options_t *o = rocksdb_options_create();
    rocksdb_options_set_create_if_missing(o, 1);
    rocksdb_options_increase_parallelism(o, 2);
    /* Pages are large, incompressible floats: keep them in blob files so
     * compaction moves only the small keys and metadata. */
    rocksdb_options_set_enable_blob_files(o, 1);
    rocksdb_options_set_min_blob_size(o, 4096);
    /* Compactions leave blob files alone: RocksDB's garbage collection
     * would rewrite the live pages of the oldest quarter of the files at
     * every compaction, dead or not (a third of the CPU of a stream of
     * appends, and their slowest ones). A file goes when all its pages are
     * deleted; kvd__blob_gc rewrites what is still alive once deleted
     * pages fill half of the files. */
    rocksdb_options_set_enable_blob_gc(o, 0);
    rocksdb_options_set_compression(o, rocksdb_no_compression);
    /* Page bytes sit in the memtable until it is flushed to blob files; the
     * memory tiers are what should hold hot pages, so keep memtables small
     * (at most two of 16 MiB: part of kvdepotd's fixed memory overhead). */
    rocksdb_options_set_write_buffer_size(o, 16u << 20);
    rocksdb_options_set_max_write_buffer_number(o, 2);
    return o;
}

/* A directory holding a store's files (tables, logs, a MANIFEST) without
 * its CURRENT file: RocksDB would begin an empty store beside them. */
static int check_current(const char *dir, kvd_error *err)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/CURRENT", dir);
    if (access(path, F_OK) == 0)
        return 0;
    DIR *d = opendir(dir);
    if (!d)
        return 0;
    struct dirent *de;
    const char *found = NULL;
    while (!found && (de = readdir(d))) {
        const char *n = de->d_name, *dot = strrchr(n, '.');
        if (strncmp(n, "MANIFEST-", 9) == 0 ||
            (dot && (!strcmp(dot, ".sst") || !strcmp(dot, ".log") || !strcmp(dot, ".blob"))))
            found = n;
    }
    int rc = found ? kvd_error_set(err, KVD_ECORRUPT,
                                   "%s holds a store (%s, ...) but not its CURRENT file, "
                                   "RocksDB's pointer to its MANIFEST: not opened, which would "
                                   "start an empty store beside it. Back up the directory, then "
                                   "run `kvdepotd repair --data-dir %s`",
                                   dir, found, dir)
                   : 0;
    closedir(d);
    return rc;
}

/* A lost CURRENT with its MANIFEST intact: point CURRENT at the newest
 * MANIFEST again, which keeps everything (blob files included). 1 when the
 * store then opens, 0 when it did not apply (CURRENT removed again). */
static int restore_current(const char *dir, rocksdb_options_t *o)
{
    char path[4096], tmp[4096], best[256] = "";
    snprintf(path, sizeof path, "%s/CURRENT", dir);
    if (access(path, F_OK) == 0)
        return 0;
    DIR *d = opendir(dir);
    if (!d)
        return 0;
    unsigned long long top = 0;
    struct dirent *de;
    while ((de = readdir(d))) {
        unsigned long long n;
        char rest;
        if (sscanf(de->d_name, "MANIFEST-%llu%c", &n, &rest) == 1 && n >= top &&
            strlen(de->d_name) < sizeof best) {
            top = n;
            snprintf(best, sizeof best, "%s", de->d_name);
        }
    }
    closedir(d);
    if (!best[0])
        return 0;
    snprintf(tmp, sizeof tmp, "%s/CURRENT.repair", dir);
    FILE *f = fopen(tmp, "w");
    if (!f)
        return 0;
    int ok = fprintf(f, "%s\n", best) > 0;
    ok = (fflush(f) == 0 && fsync(fileno(f)) == 0) && ok;
    fclose(f);
    if (!ok || rename(tmp, path) != 0) {
        unlink(tmp);
        return 0;
    }
    char *e = NULL;
    rocksdb_options_set_create_if_missing(o, 0);
    rocksdb_t *db = rocksdb_open(o, dir, &e);
    rocksdb_options_set_create_if_missing(o, 1);
    if (db) {
        rocksdb_close(db);
        return 1;
    }
    rocksdb_free(e);
    unlink(path);
    return 0;
}

int kvd_store_repair(const char *dir, int *how, kvd_repair_report *rep, kvd_error *err)
{
    kvd_repair_report ignored;
    if (!rep)
        rep = &ignored;
    memset(rep, 0, sizeof *rep);
    *how = 0;
    if (!dir || !dir[0])
        return kvd_error_set(err, KVD_EINVAL, "repair: data_dir is not set");
    rocksdb_options_t *o = db_options();
    if (restore_current(dir, o)) {
        rocksdb_options_destroy(o);
        *how = 1;
        return 0;
    }
    int rc = kvd__seq_ids_unverified(dir, rep);
    if (rc)
        rc = kvd_error_set(err, rc, "repair: out of memory listing the sequences");
    if (rc == 0)
        rc = kvd__blob_stash(dir, &rep->blob_files, err);
    char *e = NULL;
    if (rc == 0)
        rocksdb_repair_db(o, dir, &e);
    if (e) {
        rc = kvd_error_set(err, KVD_EINTERNAL, "RocksDB repair of %s failed: %s", dir, e);
        rocksdb_free(e);
    }
    if (rc == 0)
        *how = 2;
    rocksdb_options_destroy(o);
    if (rep == &ignored)
        kvd_repair_report_clear(rep);
    return rc;
}

int kvd_store_db_property(kvd_store *st, const char *name, uint64_t *out)
{
    *out = 0;
    return rocksdb_property_int(st->db, name, out) == 0 ? 0 : -1;
}

static void pending_free(kvd_store *st)
{
    while (st->pending) {
        kvd__pending *n = st->pending->next;
        free(st->pending);
        st->pending = n;
    }
    pthread_mutex_destroy(&st->pend_mu);
    pthread_mutex_destroy(&st->backup_mu);
}

kvd__pending *kvd__pending_new(const void *id, size_t len)
{
    kvd__pending *p = malloc(sizeof *p + len);
    if (p) {
        p->next = NULL;
        p->done = 0;
        p->created_ms = 0;
        p->len = len;
        memcpy(p->id, id, len);
    }
    return p;
}

void kvd__pending_add(kvd_store *st, kvd__pending *p)
{
    pthread_mutex_lock(&st->pend_mu);
    p->next = st->pending;
    st->pending = p;
    pthread_mutex_unlock(&st->pend_mu);
}

void kvd_store_seq_pending_done(kvd_store *st, const void *id, size_t id_len)
{
    if (!st)
        return;
    pthread_mutex_lock(&st->pend_mu);
    for (kvd__pending **pp = &st->pending; *pp; pp = &(*pp)->next) {
        kvd__pending *p = *pp;
        if (p->done || p->len != id_len || memcmp(p->id, id, id_len))
            continue;
        if (st->backup_running) {
            p->done = 1;
        } else {
            *pp = p->next;
            free(p);
        }
        break;
    }
    pthread_mutex_unlock(&st->pend_mu);
}

/* The backup's start (begin = 1) and end. Under st->lock, which a create
 * holds from its write to entering its entry: a sequence written before
 * the checkpoint was taken is in the list by the end. At the end, the list
 * (every entry: pending at the start, made since, done since) moves to
 * *out, and the done entries go. */
static int backup_mark(kvd_store *st, int begin, kvd__pending **out)
{
    int rc = 0;
    pthread_rwlock_rdlock(&st->lock);
    pthread_mutex_lock(&st->pend_mu);
    if (begin) {
        st->backup_running = 1;
    } else {
        st->backup_running = 0;
        *out = NULL;
        for (kvd__pending **pp = &st->pending; *pp;) {
            kvd__pending *p = *pp, *c = kvd__pending_new(p->id, p->len);
            if (!c) {
                rc = KVD_ENOMEM;
            } else {
                c->created_ms = p->created_ms;
                c->next = *out;
                *out = c;
            }
            if (p->done) {
                *pp = p->next;
                free(p);
            } else {
                pp = &p->next;
            }
        }
    }
    pthread_mutex_unlock(&st->pend_mu);
    pthread_rwlock_unlock(&st->lock);
    return rc;
}

/* Delete the sequences of `gone` from the store copied into dir (each
 * only while it is the one that was pending: made then). */
static int backup_drop(const char *dir, const kvd__pending *gone, kvd_error *err)
{
    kvd_store_options o = {.data_dir = dir};
    kvd_store *bk = NULL;
    int rc = kvd_store_open(&o, &bk, err);
    for (const kvd__pending *p = gone; rc == 0 && p; p = p->next) {
        kvd_seq_info si;
        rc = kvd_store_seq_stat(bk, p->id, p->len, &si, err);
        const int same = rc == 0 && si.created_unix_ms == p->created_ms;
        if (rc == 0)
            kvd_seq_info_clear(&si);
        if (same)
            rc = kvd_store_seq_delete(bk, p->id, p->len, NULL, err);
        if (rc == KVD_ENOTFOUND) {
            kvd_error_clear(err);
            rc = 0;
        }
    }
    kvd_store_close(bk);
    if (rc) {
        char why[sizeof err->msg];
        snprintf(why, sizeof why, "%s", err->msg);
        return kvd_error_set(err, rc,
                             "backup to %s: the sequences of appends in flight could not be "
                             "taken out of it (%.300s)",
                             dir, why);
    }
    return 0;
}

static int discard_entry(const char *path, const struct stat *sb, int type, struct FTW *ftw)
{
    (void)sb;
    (void)type;
    (void)ftw;
    return remove(path) == 0 || errno == ENOENT ? 0 : -1;
}

/* A backup that failed after its checkpoint was written: its directory
 * (made by this backup, which refuses an existing one) is removed, so that
 * no copy that must not be restored is left; err's message says so. */
static void backup_discard(const char *dir, int rc, kvd_error *err)
{
    const int ok = nftw(dir, discard_entry, 16, FTW_DEPTH | FTW_PHYS) == 0;
    const int eno = errno;
    if (!err)
        return;
    char why[sizeof err->msg];
    snprintf(why, sizeof why, "%s", err->msg);
    if (ok)
        kvd_error_set(err, rc, "%.400s; the backup was removed", why);
    else
        kvd_error_set(err, rc,
                      "%.300s; removing the backup failed too (%s): delete %.100s, do not "
                      "restore it",
                      why, strerror(eno), dir);
}

static int backup_copy(kvd_store *st, const char *dir, kvd_error *err);

int kvd_store_backup(kvd_store *st, const char *dir, uint64_t *files, uint64_t *bytes,
                     kvd_error *err)
{
    if (files)
        *files = 0;
    if (bytes)
        *bytes = 0;
    if (!st)
        return kvd_error_set(err, KVD_EINVAL, "backup: no store");
    pthread_mutex_lock(&st->backup_mu);
    backup_mark(st, 1, NULL);
    int rc = backup_copy(st, dir, err);
    const int copied = rc == 0;
    kvd__pending *gone = NULL;
    if (backup_mark(st, 0, &gone) && rc == 0)
        rc = kvd_error_set(err, KVD_ENOMEM, "backup to %s: out of memory", dir);
    pthread_mutex_unlock(&st->backup_mu);
    if (rc == 0 && gone)
        rc = backup_drop(dir, gone, err);
    while (gone) {
        kvd__pending *n = gone->next;
        free(gone);
        gone = n;
    }
    if (rc) {
        if (copied)
            backup_discard(dir, rc, err);
        return rc;
    }
    DIR *d = opendir(dir);
    struct dirent *de;
    struct stat sb;
    while (d && (de = readdir(d))) {
        char path[4096 + 256];
        snprintf(path, sizeof path, "%s/%s", dir, de->d_name);
        if (stat(path, &sb) == 0 && S_ISREG(sb.st_mode)) {
            if (files)
                (*files)++;
            if (bytes)
                *bytes += (uint64_t)sb.st_size;
        }
    }
    if (d)
        closedir(d);
    return 0;
}

/* The checkpoint itself. */
static int backup_copy(kvd_store *st, const char *dir, kvd_error *err)
{
    char parent[4096];
    size_t n = dir ? strlen(dir) : 0;
    if (n == 0 || n >= sizeof parent)
        return kvd_error_set(err, KVD_EINVAL, "backup: directory path empty or too long");
    struct stat sb;
    if (lstat(dir, &sb) == 0)
        return kvd_error_set(err, KVD_EEXIST,
                             "backup: %s exists (a backup goes to a new directory)", dir);
    memcpy(parent, dir, n + 1);
    while (n > 1 && parent[n - 1] == '/')
        parent[--n] = 0;
    char *slash = strrchr(parent, '/');
    if (slash)
        *(slash == parent ? slash + 1 : slash) = 0;
    else
        snprintf(parent, sizeof parent, ".");
    if (stat(parent, &sb) != 0 || !S_ISDIR(sb.st_mode))
        return kvd_error_set(err, KVD_EPRECOND, "backup: the parent directory %s does not exist",
                             parent);
    char *e = NULL;
    rocksdb_checkpoint_t *cp = rocksdb_checkpoint_object_create(st->db, &e);
    if (cp)
        rocksdb_checkpoint_create(cp, dir, 0, &e); /* 0: flush the memtables first */
    if (cp)
        rocksdb_checkpoint_object_destroy(cp);
    if (e) {
        int rc = kvd_error_set(err, KVD_EINTERNAL, "backup to %s failed: %s", dir, e);
        rocksdb_free(e);
        return rc;
    }
    return 0;
}

/* Read or create the store record; it pins the page size for the directory. */
static int load_meta(kvd_store *st, uint32_t want_page_tokens, kvd_error *err)
{
    char *e = NULL;
    size_t len = 0;
    char *v = rocksdb_get(st->db, st->ropt, KVD__META_KEY, KVD__META_KEY_LEN, &len, &e);
    if (e) {
        kvd_error_set(err, KVD_EINTERNAL, "rocksdb read of the store record failed: %s", e);
        rocksdb_free(e);
        return KVD_EINTERNAL;
    }
    if (v) {
        const uint8_t *p = (const uint8_t *)v;
        int rc = 0;
        if (len && p[0] > META_VERSION) {
            rc = kvd_error_set(err, KVD_EPRECOND,
                               "the data directory was written by a newer kvdepot (store format "
                               "%u; this kvdepotd reads format %u and older): run that version, or "
                               "restore a backup taken before the upgrade (docs/upgrades.md)",
                               p[0], META_VERSION);
        } else if (len != 5 || p[0] != META_VERSION) {
            rc = kvd_error_set(err, KVD_ECORRUPT, "store record: version %u, %zu bytes",
                               len ? p[0] : 0, len);
        } else {
            uint32_t pt = (uint32_t)p[1] | ((uint32_t)p[2] << 8) | ((uint32_t)p[3] << 16) |
                          ((uint32_t)p[4] << 24);
            if (pt == 0 || pt > KVD_PAGE_MAX_TOKENS)
                rc = kvd_error_set(err, KVD_ECORRUPT, "store record: page_tokens %u", pt);
            else if (want_page_tokens && want_page_tokens != pt)
                rc = kvd_error_set(err, KVD_EPRECOND,
                                   "data directory was created with page_tokens %u, not %u", pt,
                                   want_page_tokens);
            else
                st->page_tokens = pt;
        }
        rocksdb_free(v);
        return rc;
    }
    st->page_tokens = want_page_tokens ? want_page_tokens : KVD_DEFAULT_PAGE_TOKENS;
    uint8_t rec[5] = {META_VERSION, (uint8_t)st->page_tokens, (uint8_t)(st->page_tokens >> 8),
                      (uint8_t)(st->page_tokens >> 16), (uint8_t)(st->page_tokens >> 24)};
    rocksdb_writebatch_t *b = rocksdb_writebatch_create();
    rocksdb_writebatch_put(b, KVD__META_KEY, KVD__META_KEY_LEN, (const char *)rec, sizeof rec);
    int rc = kvd__db_write(st, b, err);
    rocksdb_writebatch_destroy(b);
    return rc;
}

int kvd_store_open(const kvd_store_options *opt, kvd_store **out, kvd_error *err)
{
    if (!out)
        return kvd_error_set(err, KVD_EINVAL, "store open: out is NULL");
    *out = NULL;
    if (!opt || !opt->data_dir || !opt->data_dir[0])
        return kvd_error_set(err, KVD_EINVAL, "store open: data_dir is not set");
    if (opt->page_tokens > KVD_PAGE_MAX_TOKENS)
        return kvd_error_set(err, KVD_EINVAL, "page_tokens %u exceeds %d", opt->page_tokens,
                             KVD_PAGE_MAX_TOKENS);
    int rc = mkdir_p(opt->data_dir, err);
    if (rc)
        return rc;

    kvd_store *st = calloc(1, sizeof *st);
    if (!st)
        return kvd_error_set(err, KVD_ENOMEM, "out of memory");
    pthread_rwlock_init(&st->lock, NULL);
    pthread_mutex_init(&st->pend_mu, NULL);
    pthread_mutex_init(&st->backup_mu, NULL);
    kvd__batch_pool_init(st);
    kvd__pq_cache_init(st);
    st->max_seq_tokens = opt->max_seq_tokens;
    st->durability = opt->sync_writes ? KVD_DURABILITY_SYNC : opt->durability;
    if (st->durability < KVD_DURABILITY_SPILL || st->durability > KVD_DURABILITY_SYNC) {
        rc = kvd_error_set(err, KVD_EINVAL, "unknown durability %d", opt->durability);
        goto free_early;
    }
    st->disk_limit = opt->disk_bytes;
    st->append_limit = opt->append_memory_bytes;
    st->salvage = opt->salvage;
    st->prefetch_pages = opt->prefetch_pages;
    st->be = opt->backend;
    if (!st->be) {
        kvd_cpu_options copt = {0, 0, 0, 0};
        if ((rc = kvd_backend_cpu_create(&copt, &st->own_be, err)))
            goto free_early;
        st->be = st->own_be;
    }
    st->be_coding = kvd_backend_narrow(st->be, 1);
    st->dev = opt->device;
    if ((rc = kvd__cache_init(st, opt, err)) || (rc = check_current(opt->data_dir, err))) {
        kvd__cache_fini(st);
        goto free_early;
    }
    st->dbopt = db_options();
    st->bbopt = rocksdb_block_based_options_create();
    st->cache = rocksdb_cache_create_lru(opt->block_cache_bytes ? opt->block_cache_bytes
                                                                : (size_t)64 << 20);
    rocksdb_block_based_options_set_block_cache(st->bbopt, st->cache);
    rocksdb_options_set_block_based_table_factory(st->dbopt, st->bbopt);
    st->wopt = rocksdb_writeoptions_create();
    /* sync: the WAL is fsynced before an append is acknowledged. spill: it is
     * written (to the OS) but not fsynced, so a killed process loses nothing
     * and a machine crash may lose the latest appends. none: no WAL at all;
     * what survives a kill is what RocksDB had flushed to its tables. */
    rocksdb_writeoptions_set_sync(st->wopt, st->durability == KVD_DURABILITY_SYNC);
    if (st->durability == KVD_DURABILITY_NONE)
        rocksdb_writeoptions_disable_WAL(st->wopt, 1);
    st->ropt = rocksdb_readoptions_create();
    /* WAL recovery: a record that fails its checksum stops the open
     * (kTolerateCorruptedTailRecords: only a torn write at the very end,
     * what a crash leaves, is tolerated), or, when asked, everything from
     * the damage on is dropped (kPointInTimeRecovery). */
    rocksdb_options_set_wal_recovery_mode(st->dbopt, opt->wal_point_in_time ? 2 : 0);
    if (opt->max_open_files)
        rocksdb_options_set_max_open_files(
            st->dbopt, opt->max_open_files < 32 ? 32 : (int)(opt->max_open_files & INT32_MAX));

    /* What the WAL holds, to tell what a point-in-time recovery drops. */
    void *wal_writes = opt->wal_point_in_time ? kvd__wal_scan(opt->data_dir) : NULL;
    char *e = NULL;
    st->db = rocksdb_open(st->dbopt, opt->data_dir, &e);
    if (e) {
        char wal[512];
        if (strstr(e, "Corruption") && wal_damage(opt->data_dir, wal, sizeof wal))
            rc = kvd_error_set(err, KVD_ECORRUPT,
                               "write-ahead log damaged, store not opened: appends acknowledged "
                               "after the damage would be lost (back up the data directory, "
                               "then start once with --wal-recovery point-in-time to keep what "
                               "precedes the damage and drop the rest): %.280s",
                               wal);
        else
            rc = kvd_error_set(err, strstr(e, "Corruption") ? KVD_ECORRUPT : KVD_EINTERNAL,
                               "cannot open RocksDB in %s: %s", opt->data_dir, e);
        rocksdb_free(e);
        st->db = NULL;
        kvd__wal_scan_free(wal_writes);
        kvd_store_close(st);
        return rc;
    }
    const uint64_t recovered = rocksdb_get_latest_sequence_number(st->db);
    if (opt->wal_point_in_time)
        wal_damage(opt->data_dir, st->recovery_report, sizeof st->recovery_report);
    if ((rc = load_meta(st, opt->page_tokens, err)) || (rc = kvd__load_models(st, err)) ||
        (rc = kvd__load_sequences(st, err)) || (rc = kvd__act_load(st, err)) ||
        (rc = kvd__pq_load(st, err)) || (rc = kvd__load_expiry(st, err)) ||
        (rc = kvd__wal_losses(st, wal_writes, recovered, err)) ||
        (rc = kvd__cache_start(st, err))) {
        kvd__wal_scan_free(wal_writes);
        kvd_store_close(st);
        return rc;
    }
    kvd__wal_scan_free(wal_writes);
    *out = st;
    return 0;

free_early: /* before RocksDB: what kvd_store_close would find not yet made */
    kvd_backend_free(st->own_be);
    pthread_rwlock_destroy(&st->lock);
    kvd__batch_pool_fini(st);
    kvd__pq_cache_fini(st);
    pending_free(st);
    free(st);
    return rc;
}

void kvd_store_close(kvd_store *st)
{
    if (!st)
        return;
    /* The background thread reads sequences and pages: stop it first. */
    kvd__cache_fini(st);
    for (size_t i = 0; i < st->nseqs; i++) {
        kvd__seq *s = st->seqs[i];
        for (uint32_t l = 0; l < s->num_layers; l++)
            for (uint32_t j = 0; j < s->layers[l].npages; j++)
                if (--s->layers[l].pages[j]->refs == 0)
                    free(s->layers[l].pages[j]);
        s->dead = 1;
        kvd__seq_unref(s);
    }
    free(st->seqs);
    free(st->losses);
    for (size_t i = 0; i < st->nmodels; i++) {
        kvd__model *m = st->models[i];
        for (size_t j = 0; j < m->prefixes.cap; j++) {
            kvd__prefix *p = m->prefixes.vals[j];
            if (p) {
                free(p->pages);
                free(p);
            }
        }
        kvd__map_free(&m->prefixes);
        free(m);
    }
    free(st->models);
    if (st->db) {
        /* Make acknowledged but unsynced writes durable before exit. */
        rocksdb_flushoptions_t *fo = rocksdb_flushoptions_create();
        rocksdb_flushoptions_set_wait(fo, 1);
        char *e = NULL;
        rocksdb_flush(st->db, fo, &e);
        rocksdb_free(e);
        rocksdb_flushoptions_destroy(fo);
        rocksdb_close(st->db);
    }
    if (st->ropt)
        rocksdb_readoptions_destroy(st->ropt);
    if (st->wopt)
        rocksdb_writeoptions_destroy(st->wopt);
    if (st->dbopt)
        rocksdb_options_destroy(st->dbopt);
    if (st->bbopt)
        rocksdb_block_based_options_destroy(st->bbopt);
    if (st->cache)
        rocksdb_cache_destroy(st->cache);
    kvd_backend_free(st->own_be);
    kvd__batch_pool_fini(st);
    kvd__pq_cache_fini(st);
    pending_free(st);
    pthread_rwlock_destroy(&st->lock);
    free(st);
}
