/*
 * `kvdepotd repair`: bring back a store whose RocksDB files are damaged
 * (a table that fails its checksum, a lost MANIFEST or CURRENT), then say
 * which sequences lost pages.
 *
 * RocksDB's repair rebuilds the MANIFEST and CURRENT from the table files
 * it can read; records in tables it cannot read are gone. The blob files
 * (page bytes) are moved aside first and written back where the tables
 * still point at them (store/salvage.c). The store is then opened and every
 * page of every sequence is read and verified (its checksum): a sequence
 * whose record survived but some of whose pages did not is reported with
 * the count; one whose record is gone (it was in a table RocksDB set
 * aside) is named from the ids listed before the repair, read without
 * verifying checksums.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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
    const kvd_blob_salvage blobs = rep.blobs;
    if (how == 1)
        fprintf(stderr, "%s: CURRENT was missing: written again, pointing at the newest MANIFEST\n",
                prog);
    else
        fprintf(stderr,
                "%s: the MANIFEST was rebuilt from the table files (RocksDB repair); blob "
                "files: %" PRIu64 " read, %" PRIu64 " records, %" PRIu64 " written back, %" PRIu64
                " no longer referenced, %" PRIu64 " failed their checksum\n",
                prog, blobs.files, blobs.records, blobs.written, blobs.unindexed,
                blobs.bad_records);
    if (blobs.unreadable)
        fprintf(stderr,
                "%s: %" PRIu64 " blob files could not be read and are kept in %s/repair-blobs "
                "(first: %s)\n",
                prog, blobs.unreadable, cfg->data_dir, blobs.first_unreadable);
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
