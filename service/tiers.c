/*
 * Tier RPCs: Stats (per-tier bytes, pages, hits, evictions, and the store's
 * counters) and EvictSequence (move a sequence's pages out of memory).
 */
#include <string.h>
#include <time.h>

#include "compute.h"
#include "kvdepot/v1/kvdepot.pb-c.h"
#include "log.h"
#include "metrics.h"
#include "rpc.h"
#include "validate.h"

static const char *durability_name(int d)
{
    return d == KVD_DURABILITY_NONE ? "none" : d == KVD_DURABILITY_SYNC ? "sync" : "spill";
}

int kvd_h_stats(kvd_req_ctx *ctx, const ProtobufCMessage *msg, grpc_byte_buffer **reply,
                kvd_error *err)
{
    (void)msg;
    kvd_store_stats s;
    if (kvd_store_stats_get(ctx->svc->store, &s))
        return kvd_error_set(err, KVD_EINTERNAL, "store statistics unavailable");
    static const char *names[KVD_TIERS] = {"device", "host", "disk"};
    Kvdepot__V1__TierStats t[KVD_TIERS], *tp[KVD_TIERS];
    for (int i = 0; i < KVD_TIERS; i++) {
        kvdepot__v1__tier_stats__init(&t[i]);
        t[i].name = (char *)names[i];
        t[i].limit_bytes = s.tier_limit[i];
        t[i].bytes = s.tier_bytes[i];
        t[i].pages = s.tier_pages[i];
        t[i].hits = i < 2 ? s.hits[i] : s.misses;
        t[i].evictions = i < 2 ? s.evictions[i] : s.sequences_dropped;
        tp[i] = &t[i];
    }
    Kvdepot__V1__StatsResponse resp = KVDEPOT__V1__STATS_RESPONSE__INIT;
    resp.durability = (char *)durability_name(s.durability);
    resp.n_tiers = KVD_TIERS;
    resp.tiers = tp;
    resp.misses = s.misses;
    resp.promotions = s.promotions;
    resp.prefetched = s.prefetched;
    resp.checksum_failures = s.checksum_failures;
    resp.sequences_dropped = s.sequences_dropped;
    resp.sequences_expired = s.sequences_expired;
    resp.sequences = s.sequences;
    kvd_backend *be = kvd_store_backend(ctx->svc->store);
    kvd_backend *dev = kvd_store_device_opened(ctx->svc->store);
    kvd_backend_desc d;
    kvd_backend_describe(dev ? dev : be, &d);
    resp.backend = (char *)(dev ? dev : be)->iface->name;
    resp.backend_threads = (uint32_t)be->nthreads;
    resp.device = d.device;
    resp.device_memory_bytes = d.memory_bytes;
    resp.device_healthy = d.healthy;
    resp.device_pages_attended = kvd_compute_device_pages();
    resp.device_pages_searched = kvd_compute_device_search_pages();
    resp.device_pages_encoded = s.device_pages_encoded;
    resp.device_fallbacks = s.device_fallbacks;
    resp.device_pages_placed = s.device_pages_placed;
    Kvdepot__V1__MemoryStats mem = KVDEPOT__V1__MEMORY_STATS__INIT;
    mem.rss_bytes = kvd_process_rss();
    mem.appends_bytes = s.mem_appends;
    mem.memtables_bytes = s.mem_memtables;
    mem.block_cache_bytes = s.mem_block_cache;
    resp.memory = &mem;
    if (ctx->principal && !ctx->principal->admin) {
        /* A tenant learns its own usage, and how the server is set up;
         * what the others hold and do is for admin tokens. */
        uint64_t seqs, bytes;
        kvd_auth_usage(ctx->auth, ctx->principal, &seqs, &bytes);
        for (int i = 0; i < KVD_TIERS; i++)
            t[i].bytes = t[i].pages = t[i].hits = t[i].evictions = 0;
        t[KVD_TIER_DISK].bytes = bytes;
        resp.misses = resp.promotions = resp.prefetched = resp.checksum_failures = 0;
        resp.sequences_dropped = resp.sequences_expired = 0;
        resp.sequences = seqs;
        resp.device_pages_attended = resp.device_pages_searched = 0;
        resp.device_pages_encoded = resp.device_fallbacks = resp.device_pages_placed = 0;
        resp.memory = NULL;
    }
    *reply = kvd_pack(&resp.base);
    return *reply ? 0 : kvd_error_set(err, KVD_ENOMEM, "out of memory packing the reply");
}

int kvd_h_backup(kvd_req_ctx *ctx, const ProtobufCMessage *msg, grpc_byte_buffer **reply,
                 kvd_error *err)
{
    const Kvdepot__V1__BackupRequest *req = (const Kvdepot__V1__BackupRequest *)msg;
    if (ctx->principal && !ctx->principal->admin)
        return kvd_error_set(err, KVD_EPERM,
                             "Backup copies every tenant's data: it needs a token "
                             "with access: admin");
    const char *dir = req->dir ? req->dir : "";
    if (dir[0] != '/')
        return kvd_error_set(err, KVD_EINVAL,
                             "dir \"%.200s\": an absolute path on the server's host is required",
                             dir);
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    uint64_t files = 0, bytes = 0;
    int rc = kvd_store_backup(ctx->svc->store, dir, &files, &bytes, err);
    if (rc)
        return rc;
    clock_gettime(CLOCK_MONOTONIC, &t1);
    uint64_t ms = (uint64_t)((t1.tv_sec - t0.tv_sec) * 1000 + (t1.tv_nsec - t0.tv_nsec) / 1000000);
    char qdir[1100];
    kvd_log_quote(qdir, sizeof qdir, dir, strlen(dir));
    KVD_LOG(KVD_LOG_INFO, "backup written", "dir=%s files=%llu bytes=%llu ms=%llu", qdir,
            (unsigned long long)files, (unsigned long long)bytes, (unsigned long long)ms);
    Kvdepot__V1__BackupResponse resp = KVDEPOT__V1__BACKUP_RESPONSE__INIT;
    resp.files = files;
    resp.bytes = bytes;
    resp.duration_ms = ms;
    *reply = kvd_pack(&resp.base);
    return *reply ? 0 : kvd_error_set(err, KVD_ENOMEM, "out of memory packing the reply");
}

int kvd_h_evict_sequence(kvd_req_ctx *ctx, const ProtobufCMessage *msg, grpc_byte_buffer **reply,
                         kvd_error *err)
{
    const Kvdepot__V1__EvictSequenceRequest *req = (const Kvdepot__V1__EvictSequenceRequest *)msg;
    int rc;
    kvd_seq_key key;
    if ((rc = kvd_ctx_seq_key(ctx, &req->sequence_id, "sequence_id", &key, err)) ||
        (rc = kvd_ctx_check_seq(ctx, key.id, key.len, err)))
        return rc;
    uint64_t pages = 0, bytes = 0;
    if ((rc = kvd_store_seq_evict(ctx->svc->store, key.id, key.len, &pages, &bytes, err)))
        return rc;
    Kvdepot__V1__EvictSequenceResponse resp = KVDEPOT__V1__EVICT_SEQUENCE_RESPONSE__INIT;
    resp.pages = pages;
    resp.bytes = bytes;
    *reply = kvd_pack(&resp.base);
    return *reply ? 0 : kvd_error_set(err, KVD_ENOMEM, "out of memory packing the reply");
}
