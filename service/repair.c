/*
 * The offline commands of kvdepotd. `kvdepotd restore BACKUP`: copy a
 * backup (the Backup RPC's RocksDB checkpoint) into a new data directory
 * and check that it opens. `kvdepotd repair`: bring back a store whose
 * RocksDB files are damaged (a table that fails its checksum, a lost
 * MANIFEST or CURRENT), then say which sequences lost pages.
 *
 * RocksDB's repair rebuilds the MANIFEST and CURRENT from the table files
 * it can read; records in tables it cannot read are gone, and it cannot
 * carry the blob files (page bytes) over: they are moved aside into
 * repair-blobs/ (store/salvage.c). The store is then opened and every
 * page of every sequence is read and verified (its checksum): a sequence
 * whose record survived but some of whose pages did not is reported with
 * the count; one whose record is gone (it was in a table RocksDB set
 * aside) is named from the ids listed before the repair, read without
 * verifying checksums.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "config.h"
#include "log.h"
#include "server.h"
#include "store.h"

/* Mark id as still held in the ids listed before the repair (sorted as
 * RocksDB sorts keys: bytes, then length). */
static void mark_held(const kvd_repair_report *rep, uint8_t *held, const uint8_t *id, size_t len)
{
    size_t lo = 0, hi = rep->nids;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2, ml = rep->id_lens[mid];
        int c = memcmp(rep->ids[mid], id, ml < len ? ml : len);
        if (c == 0 && ml == len) {
            held[mid] = 1;
            return;
        }
        if (c < 0 || (c == 0 && ml < len))
            lo = mid + 1;
        else
            hi = mid;
    }
}

/* Read and verify every page of one sequence: the pages that fail. */
static uint64_t check_seq(kvd_store *st, const kvd_seq_info *s, uint64_t *pages, char *first,
                          size_t cap)
{
    uint64_t bad = 0;
    for (uint32_t l = 0; l < s->num_layers; l++) {
        const uint64_t blocks = (s->layer_tokens[l] + s->page_tokens - 1) / s->page_tokens;
        for (uint64_t b = 0; b < blocks; b++) {
            kvd_page_handle h;
            kvd_error e;
            kvd_error_clear(&e);
            (*pages)++;
            if (kvd_store_page_acquire(st, s->id, s->id_len, l, b, &h, &e) == 0) {
                kvd_store_page_release(st, &h);
                continue;
            }
            if (!bad++)
                snprintf(first, cap, "layer %u page %" PRIu64 ": %s", l, b, e.msg);
        }
    }
    return bad;
}

int kvd_repair_run(const kvd_config *cfg, const char *prog)
{
    kvd_error err;
    kvd_error_clear(&err);
    fprintf(stderr, "%s: repairing the store in %s\n", prog, cfg->data_dir);
    int how = 0;
    kvd_repair_report rep;
    if (kvd_store_repair(cfg->data_dir, &how, &rep, &err)) {
        fprintf(stderr, "%s: %s\n", prog, err.msg);
        kvd_repair_report_clear(&rep);
        return 1;
    }
    if (how == 1)
        fprintf(stderr, "%s: CURRENT was missing: written again, pointing at the newest MANIFEST\n",
                prog);
    else
        fprintf(stderr,
                "%s: the MANIFEST was rebuilt from the table files (RocksDB repair); RocksDB's "
                "repair cannot carry blob files over: the %" PRIu64 " blob files (page bytes) "
                "were moved to %s/repair-blobs, and their pages answer DATA_LOSS (keep the "
                "directory for a manual salvage, or remove it)\n",
                prog, rep.blob_files, cfg->data_dir);
    kvd_store_options o = {
        .data_dir = cfg->data_dir, .page_tokens = (uint32_t)cfg->page_tokens, .salvage = 1};
    kvd_store *st = NULL;
    uint8_t *held = calloc(rep.nids ? rep.nids : 1, 1);
    if (!held || kvd_store_open(&o, &st, &err)) {
        fprintf(stderr, "%s: the repaired store does not open: %s\n", prog,
                held ? err.msg : "out of memory");
        free(held);
        kvd_repair_report_clear(&rep);
        return 1;
    }
    uint64_t nseq = 0, damaged = 0, pages = 0, bad_pages = 0;
    const kvd_recovery_loss *lost;
    size_t nlost = kvd_store_recovery_losses(st, &lost);
    for (size_t i = 0; i < nlost; i++) {
        char id[4 * KVD_SEQ_ID_MAX + 3];
        kvd_log_quote(id, sizeof id, (const char *)lost[i].id, lost[i].id_len);
        printf("sequence %s: lost (its record, or its model's, was unreadable; deleted)\n", id);
        mark_held(&rep, held, lost[i].id, lost[i].id_len);
    }
    uint8_t after[KVD_SEQ_ID_MAX];
    size_t after_len = 0;
    int more = 1, rc = 0;
    while (more && rc == 0) {
        kvd_seq_info *list = NULL;
        size_t n = 0;
        if ((rc = kvd_store_seq_list(st, NULL, after_len ? after : NULL, after_len, 256, &list, &n,
                                     &more, &err))) {
            fprintf(stderr, "%s: listing sequences: %s\n", prog, err.msg);
            break;
        }
        for (size_t i = 0; i < n; i++) {
            char first[400] = "", id[4 * KVD_SEQ_ID_MAX + 3];
            uint64_t np = 0, bad = check_seq(st, &list[i], &np, first, sizeof first);
            nseq++;
            mark_held(&rep, held, list[i].id, list[i].id_len);
            pages += np;
            bad_pages += bad;
            if (bad) {
                damaged++;
                kvd_log_quote(id, sizeof id, (const char *)list[i].id, list[i].id_len);
                printf("sequence %s: %" PRIu64 " of %" PRIu64 " pages lost (%s)\n", id, bad, np,
                       first);
            }
        }
        if (n) {
            memcpy(after, list[n - 1].id, list[n - 1].id_len);
            after_len = list[n - 1].id_len;
        }
        for (size_t i = 0; i < n; i++)
            kvd_seq_info_clear(&list[i]);
        free(list);
    }
    size_t gone = 0;
    for (size_t i = 0; rc == 0 && i < rep.nids; i++) {
        if (held[i])
            continue;
        char id[4 * KVD_SEQ_ID_MAX + 3];
        kvd_log_quote(id, sizeof id, (const char *)rep.ids[i], rep.id_lens[i]);
        printf("sequence %s: lost (its record was in a damaged table)\n", id);
        gone++;
    }
    nlost += gone;
    free(held);
    kvd_repair_report_clear(&rep);
    kvd_store_close(st);
    if (rc)
        return 1;
    printf("repaired: %" PRIu64 " sequences, %" PRIu64 " pages checked; %" PRIu64
           " sequences lost %" PRIu64 " pages (reads of those pages answer DATA_LOSS); %zu "
           "sequences lost\n",
           nseq, pages, damaged, bad_pages, nlost);
    return damaged || nlost ? 3 : 0;
}

/* Copy one file, fsynced; 0 or -1 (errno). */
static int copy_file(const char *from, const char *to, uint64_t *bytes)
{
    int in = open(from, O_RDONLY | O_CLOEXEC);
    int out = in < 0 ? -1 : open(to, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    int rc = in < 0 || out < 0 ? -1 : 0;
    static char buf[1 << 20];
    while (rc == 0) {
        ssize_t n = read(in, buf, sizeof buf);
        if (n == 0)
            break;
        if (n < 0 || write(out, buf, (size_t)n) != n) {
            rc = -1;
            break;
        }
        *bytes += (uint64_t)n;
    }
    if (rc == 0 && fsync(out) != 0)
        rc = -1;
    int e = errno;
    if (in >= 0)
        close(in);
    if (out >= 0)
        close(out);
    errno = e;
    return rc;
}

int kvd_restore_run(const kvd_config *cfg, const char *backup, const char *prog)
{
    const char *dir = cfg->data_dir;
    char path[4096], to[4096];
    snprintf(path, sizeof path, "%s/CURRENT", backup);
    if (access(path, R_OK) != 0) {
        fprintf(stderr, "%s: %s is not a kvdepot backup (no CURRENT file)\n", prog, backup);
        return 1;
    }
    DIR *d = opendir(dir);
    if (d) {
        struct dirent *de;
        int empty = 1;
        while ((de = readdir(d)))
            if (strcmp(de->d_name, ".") && strcmp(de->d_name, ".."))
                empty = 0;
        closedir(d);
        if (!empty) {
            fprintf(stderr,
                    "%s: %s is not empty: restore into a new directory (nothing was changed)\n",
                    prog, dir);
            return 1;
        }
    } else if (mkdir(dir, 0700) != 0) {
        fprintf(stderr, "%s: cannot create %s: %s\n", prog, dir, strerror(errno));
        return 1;
    }
    d = opendir(backup);
    if (!d) {
        fprintf(stderr, "%s: cannot read %s: %s\n", prog, backup, strerror(errno));
        return 1;
    }
    uint64_t files = 0, bytes = 0;
    int rc = 0;
    struct dirent *de;
    while (rc == 0 && (de = readdir(d))) {
        struct stat sb;
        if (snprintf(path, sizeof path, "%s/%s", backup, de->d_name) >= (int)sizeof path ||
            snprintf(to, sizeof to, "%s/%s", dir, de->d_name) >= (int)sizeof to ||
            stat(path, &sb) != 0 || !S_ISREG(sb.st_mode))
            continue;
        if (copy_file(path, to, &bytes) != 0) {
            fprintf(stderr, "%s: copying %s to %s: %s\n", prog, path, to, strerror(errno));
            rc = 1;
        }
        files++;
    }
    closedir(d);
    int dfd = rc ? -1 : open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd >= 0) {
        fsync(dfd);
        close(dfd);
    }
    if (rc)
        return 1;
    kvd_store_options o = {.data_dir = dir};
    kvd_store *st = NULL;
    kvd_error err;
    kvd_error_clear(&err);
    if (kvd_store_open(&o, &st, &err)) {
        fprintf(stderr, "%s: the restored store in %s does not open: %s\n", prog, dir, err.msg);
        return 1;
    }
    kvd_store_close(st);
    printf("restored %" PRIu64 " files (%" PRIu64 " bytes) from %s into %s\n", files, bytes, backup,
           dir);
    return 0;
}
