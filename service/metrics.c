#include "metrics.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <netdb.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <microhttpd.h>

#include "compute.h"
#include "kvdepot/status.h"
#include "rpc.h"

kvd_metrics_registry kvd_metrics;

/* Latency bucket bounds in seconds: 100 us .. 60 s, roughly x2.5 apart. */
static const double bucket_le[] = {0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                                   0.1,    0.25,    0.5,    1,     2.5,    5,     10,   30,    60};
#define NBUCKETS (sizeof bucket_le / sizeof bucket_le[0])
#define MAX_METHODS 32 /* room for the method table to grow; the last is "unknown" */
#define NSTATUS 17     /* gRPC codes 0..16 */

typedef struct call_series {
    _Atomic uint64_t count;
    _Atomic uint64_t sum_us;
    _Atomic uint64_t buckets[NBUCKETS]; /* non-cumulative; summed when rendered */
} call_series;

static call_series series[MAX_METHODS][NSTATUS];

_Static_assert(MAX_METHODS > 16, "method table outgrew the metrics slots");

void kvd_metrics_observe(int method, int status, double seconds)
{
    size_t m = method >= 0 && (size_t)method < kvd_methods_count && method < MAX_METHODS - 1
                   ? (size_t)method
                   : MAX_METHODS - 1;
    int code = kvd_status_to_grpc(status);
    if (code < 0 || code >= NSTATUS)
        code = 2; /* UNKNOWN */
    call_series *s = &series[m][code];
    atomic_fetch_add_explicit(&s->count, 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&s->sum_us, (uint64_t)(seconds * 1e6), memory_order_relaxed);
    for (size_t b = 0; b < NBUCKETS; b++)
        if (seconds <= bucket_le[b]) {
            atomic_fetch_add_explicit(&s->buckets[b], 1, memory_order_relaxed);
            break;
        }
}

/* ---- rendering ----------------------------------------------------------- */

typedef struct buf {
    char *p;
    size_t len, cap;
    int oom;
} buf;

static void put(buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void put(buf *b, const char *fmt, ...)
{
    if (b->oom)
        return;
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        int n = vsnprintf(b->p + b->len, b->cap - b->len, fmt, ap);
        va_end(ap);
        if (n < 0) {
            b->oom = 1;
            return;
        }
        if ((size_t)n < b->cap - b->len) {
            b->len += (size_t)n;
            return;
        }
        size_t ncap = b->cap * 2 + (size_t)n;
        char *np = realloc(b->p, ncap);
        if (!np) {
            b->oom = 1;
            return;
        }
        b->p = np;
        b->cap = ncap;
    }
}

static const char *method_name(size_t m)
{
    return m < kvd_methods_count && m < MAX_METHODS - 1 ? kvd_methods[m].name : "unknown";
}

static const char *code_name(int code)
{
    return code == 0 ? "OK" : kvd_status_name(-code);
}

struct kvd_store *_Atomic kvd_metrics_store;
struct kvd_service *_Atomic kvd_metrics_service;

/* The store's tier gauges and counters, the same numbers as the Stats RPC. */
static void render_tiers(buf *b)
{
    struct kvd_store *st = atomic_load(&kvd_metrics_store);
    kvd_store_stats s;
    if (!st || kvd_store_stats_get(st, &s))
        return;
    static const char *tn[KVD_TIERS] = {"device", "host", "disk"};
    static const char *dn[3] = {"spill", "none", "sync"};
    const kvd_backend *be = kvd_store_backend(st), *dev = kvd_store_device_opened(st);
    kvd_backend_desc d;
    kvd_backend_describe(dev ? dev : be, &d);
    char devq[sizeof d.device];
    size_t o = 0;
    for (const char *p = d.device; *p && o + 1 < sizeof devq; p++)
        if (*p != '"' && *p != '\\' && *p != '\n')
            devq[o++] = *p;
    devq[o] = '\0';
    put(b,
        "# HELP kvdepot_backend_info where the device tier is held and attended (cuda or cpu), "
        "the GPU, and the threads of the CPU ops\n"
        "# TYPE kvdepot_backend_info gauge\n"
        "kvdepot_backend_info{backend=\"%s\",device=\"%s\",threads=\"%d\"} 1\n",
        (dev ? dev : be)->iface->name, devq, be->nthreads);
    put(b,
        "# HELP kvdepot_device_memory_bytes memory of the GPU in use (0 on the CPU)\n"
        "# TYPE kvdepot_device_memory_bytes gauge\nkvdepot_device_memory_bytes %llu\n"
        "# HELP kvdepot_device_healthy 0 once a device error left the GPU unusable\n"
        "# TYPE kvdepot_device_healthy gauge\nkvdepot_device_healthy %d\n"
        "# HELP kvdepot_device_pages_attended_total pages Attend read where they lie on the GPU\n"
        "# TYPE kvdepot_device_pages_attended_total counter\n"
        "kvdepot_device_pages_attended_total %llu\n"
        "# HELP kvdepot_device_pages_searched_total pages whose PQ codes Search read on the GPU\n"
        "# TYPE kvdepot_device_pages_searched_total counter\n"
        "kvdepot_device_pages_searched_total %llu\n"
        "# HELP kvdepot_device_pages_encoded_total pages an Append coded on the GPU\n"
        "# TYPE kvdepot_device_pages_encoded_total counter\n"
        "kvdepot_device_pages_encoded_total %llu\n"
        "# HELP kvdepot_device_pages_placed_total pages an Append coded on the GPU and put in its "
        "tier where they were coded\n"
        "# TYPE kvdepot_device_pages_placed_total counter\n"
        "kvdepot_device_pages_placed_total %llu\n"
        "# HELP kvdepot_device_fallbacks_total work the GPU failed (lost, or out of memory) and "
        "the CPU did again\n"
        "# TYPE kvdepot_device_fallbacks_total counter\nkvdepot_device_fallbacks_total %llu\n",
        (unsigned long long)d.memory_bytes, d.healthy,
        (unsigned long long)kvd_compute_device_pages(),
        (unsigned long long)kvd_compute_device_search_pages(),
        (unsigned long long)s.device_pages_encoded, (unsigned long long)s.device_pages_placed,
        (unsigned long long)s.device_fallbacks);
    const kvd_recovery_loss *loss;
    put(b,
        "# HELP kvdepot_wal_recovery_sequences_lost sequences whose acknowledged writes the "
        "point-in-time recovery of a damaged write-ahead log dropped at this start\n"
        "# TYPE kvdepot_wal_recovery_sequences_lost gauge\nkvdepot_wal_recovery_sequences_lost "
        "%zu\n",
        kvd_store_recovery_losses(st, &loss));
    put(b,
        "# HELP kvdepot_background_lane_starved 1 while long requests' background compute "
        "threads, kept off the CPUs (busy processes share kvdepotd's cgroup or session), have "
        "turned the lane off: long requests compute on their own threads until it is tried "
        "again (30 s later, twice as long each time it starves again soon after); where it "
        "keeps starving, set --background-priority off\n"
        "# TYPE kvdepot_background_lane_starved gauge\nkvdepot_background_lane_starved %d\n"
        "# HELP kvdepot_background_lane_starvations_total times the background lane turned "
        "itself off\n"
        "# TYPE kvdepot_background_lane_starvations_total counter\n"
        "kvdepot_background_lane_starvations_total %ld\n",
        kvd_cpu_background_starved(), kvd_cpu_background_starvations());
    put(b,
        "# HELP kvdepot_durability_info durability setting in force\n"
        "# TYPE kvdepot_durability_info gauge\nkvdepot_durability_info{durability=\"%s\"} 1\n",
        dn[s.durability]);
    put(b, "# HELP kvdepot_tier_limit_bytes byte limit of each tier (0: off, or unlimited disk)\n"
           "# TYPE kvdepot_tier_limit_bytes gauge\n");
    for (int i = 0; i < KVD_TIERS; i++)
        put(b, "kvdepot_tier_limit_bytes{tier=\"%s\"} %llu\n", tn[i],
            (unsigned long long)s.tier_limit[i]);
    put(b, "# HELP kvdepot_tier_bytes page bytes held in each tier\n"
           "# TYPE kvdepot_tier_bytes gauge\n");
    for (int i = 0; i < KVD_TIERS; i++)
        put(b, "kvdepot_tier_bytes{tier=\"%s\"} %llu\n", tn[i],
            (unsigned long long)s.tier_bytes[i]);
    put(b, "# HELP kvdepot_tier_pages pages held in each tier\n# TYPE kvdepot_tier_pages gauge\n");
    for (int i = 0; i < KVD_TIERS; i++)
        put(b, "kvdepot_tier_pages{tier=\"%s\"} %llu\n", tn[i],
            (unsigned long long)s.tier_pages[i]);
    put(b, "# HELP kvdepot_tier_hits_total page reads served by each tier (disk: misses)\n"
           "# TYPE kvdepot_tier_hits_total counter\n");
    for (int i = 0; i < KVD_TIERS; i++)
        put(b, "kvdepot_tier_hits_total{tier=\"%s\"} %llu\n", tn[i],
            (unsigned long long)(i < 2 ? s.hits[i] : s.misses));
    put(b, "# HELP kvdepot_tier_evictions_total pages moved out of each memory tier\n"
           "# TYPE kvdepot_tier_evictions_total counter\n");
    for (int i = 0; i < 2; i++)
        put(b, "kvdepot_tier_evictions_total{tier=\"%s\"} %llu\n", tn[i],
            (unsigned long long)s.evictions[i]);
    put(b,
        "# HELP kvdepot_tier_promotions_total pages moved up a tier\n"
        "# TYPE kvdepot_tier_promotions_total counter\nkvdepot_tier_promotions_total %llu\n"
        "# HELP kvdepot_prefetched_pages_total pages loaded ahead of a reader\n"
        "# TYPE kvdepot_prefetched_pages_total counter\nkvdepot_prefetched_pages_total %llu\n"
        "# HELP kvdepot_sequences_dropped_total sequences dropped by the disk limit "
        "(durability none)\n# TYPE kvdepot_sequences_dropped_total counter\n"
        "kvdepot_sequences_dropped_total %llu\n"
        "# HELP kvdepot_sequences_expired_total sequences deleted by their TTL\n"
        "# TYPE kvdepot_sequences_expired_total counter\nkvdepot_sequences_expired_total %llu\n",
        (unsigned long long)s.promotions, (unsigned long long)s.prefetched,
        (unsigned long long)s.sequences_dropped, (unsigned long long)s.sequences_expired);
    put(b,
        "# HELP kvdepot_memory_bytes the server's memory by part (the tiers' pages: "
        "kvdepot_tier_bytes)\n# TYPE kvdepot_memory_bytes gauge\n"
        "kvdepot_memory_bytes{part=\"rss\"} %llu\nkvdepot_memory_bytes{part=\"appends\"} %llu\n"
        "kvdepot_memory_bytes{part=\"memtables\"} %llu\n"
        "kvdepot_memory_bytes{part=\"block_cache\"} %llu\n",
        (unsigned long long)kvd_process_rss(), (unsigned long long)s.mem_appends,
        (unsigned long long)s.mem_memtables, (unsigned long long)s.mem_block_cache);
}

/* The process: Prometheus's conventional process_* series, and threads. */
static void render_process(buf *b)
{
    struct rusage ru;
    double cpu = 0;
    if (getrusage(RUSAGE_SELF, &ru) == 0)
        cpu = (double)ru.ru_utime.tv_sec + (double)ru.ru_stime.tv_sec +
              1e-6 * (double)(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec);
    unsigned long long fds = 0, threads = 0, vsize = 0, start_ticks = 0, btime = 0;
    DIR *d = opendir("/proc/self/fd");
    struct dirent *de;
    while (d && (de = readdir(d)))
        fds += de->d_name[0] != '.';
    if (d) {
        closedir(d);
        fds--; /* the directory's own descriptor */
    }
    char line[1024];
    FILE *f = fopen("/proc/self/stat", "r");
    if (f && fgets(line, sizeof line, f)) {
        /* after "pid (comm) ": field 3 on; threads is 20, starttime 22, vsize 23 */
        const char *p = strrchr(line, ')');
        if (p)
            sscanf(p + 2,
                   "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %*u %*u %*d %*d %*d %*d %llu %*d "
                   "%llu %llu",
                   &threads, &start_ticks, &vsize);
    }
    if (f)
        fclose(f);
    f = fopen("/proc/stat", "r");
    while (f && fgets(line, sizeof line, f))
        if (sscanf(line, "btime %llu", &btime) == 1)
            break;
    if (f)
        fclose(f);
    const long hz = sysconf(_SC_CLK_TCK);
    struct rlimit rl;
    unsigned long long maxfds =
        getrlimit(RLIMIT_NOFILE, &rl) == 0 ? (unsigned long long)rl.rlim_cur : 0;
    put(b,
        "# HELP process_cpu_seconds_total user and system CPU time of the process\n"
        "# TYPE process_cpu_seconds_total counter\nprocess_cpu_seconds_total %.3f\n"
        "# HELP process_resident_memory_bytes resident memory\n"
        "# TYPE process_resident_memory_bytes gauge\nprocess_resident_memory_bytes %llu\n"
        "# HELP process_virtual_memory_bytes virtual memory\n"
        "# TYPE process_virtual_memory_bytes gauge\nprocess_virtual_memory_bytes %llu\n"
        "# HELP process_open_fds open file descriptors\n"
        "# TYPE process_open_fds gauge\nprocess_open_fds %llu\n"
        "# HELP process_max_fds the descriptor limit (soft)\n"
        "# TYPE process_max_fds gauge\nprocess_max_fds %llu\n"
        "# HELP process_threads threads of the process\n"
        "# TYPE process_threads gauge\nprocess_threads %llu\n"
        "# HELP process_start_time_seconds start of the process, seconds since the epoch\n"
        "# TYPE process_start_time_seconds gauge\nprocess_start_time_seconds %.2f\n"
        "# HELP kvdepot_build_info the running build\n# TYPE kvdepot_build_info gauge\n"
        "kvdepot_build_info{version=\"%s\",store_format=\"%d\"} 1\n",
        cpu, (unsigned long long)kvd_process_rss(), vsize, fds, maxfds, threads,
        hz > 0 && btime ? (double)btime + (double)start_ticks / (double)hz : 0.0, KVD_VERSION,
        KVD_STORE_FORMAT);
}

/* RocksDB's figures: compactions, write stalls, and the bytes of its files
 * (space amplification = total / live). */
static void render_rocksdb(buf *b, struct kvd_store *st)
{
    static const struct {
        const char *metric, *type, *help, *label, *prop;
    } P[] = {
        {"rocksdb_pending_compaction_bytes", "gauge", "bytes compactions still have to rewrite",
         NULL, "rocksdb.estimate-pending-compaction-bytes"},
        {"rocksdb_running_compactions", "gauge", "compactions running", NULL,
         "rocksdb.num-running-compactions"},
        {"rocksdb_write_stopped", "gauge",
         "1 while RocksDB stops writes (too many files to compact)", NULL,
         "rocksdb.is-write-stopped"},
        {"rocksdb_delayed_write_rate", "gauge",
         "bytes/s writes are slowed to while compactions catch up (0: not slowed)", NULL,
         "rocksdb.actual-delayed-write-rate"},
        {"rocksdb_background_errors_total", "counter",
         "background errors (flushes, compactions) RocksDB met", NULL, "rocksdb.background-errors"},
        {"rocksdb_sst_bytes", "gauge", "bytes of table files: live (in the current version), total",
         "live", "rocksdb.live-sst-files-size"},
        {NULL, NULL, NULL, "total", "rocksdb.total-sst-files-size"},
        {"rocksdb_blob_bytes", "gauge",
         "bytes of blob files (pages): live, total, and garbage (deleted pages not yet collected)",
         "live", "rocksdb.live-blob-file-size"},
        {NULL, NULL, NULL, "total", "rocksdb.total-blob-file-size"},
        {NULL, NULL, NULL, "garbage", "rocksdb.live-blob-file-garbage-size"},
    };
    const char *name = NULL;
    for (size_t i = 0; i < sizeof P / sizeof P[0]; i++) {
        uint64_t v = 0;
        if (kvd_store_db_property(st, P[i].prop, &v) != 0)
            v = 0;
        if (P[i].metric) {
            name = P[i].metric;
            put(b, "# HELP kvdepot_%s %s\n# TYPE kvdepot_%s %s\n", name, P[i].help, name,
                P[i].type);
        }
        if (P[i].label)
            put(b, "kvdepot_%s{kind=\"%s\"} %llu\n", name, P[i].label, (unsigned long long)v);
        else
            put(b, "kvdepot_%s %llu\n", name, (unsigned long long)v);
    }
}

/* A label value as the text format wants it (\\, \" and \n escaped). */
static void label_value(char *out, size_t cap, const char *s)
{
    size_t o = 0;
    for (; *s && o + 3 < cap; s++) {
        if (*s == '\\' || *s == '"' || *s == '\n')
            out[o++] = '\\';
        out[o++] = *s == '\n' ? 'n' : *s;
    }
    out[o] = '\0';
}

/* Each tenant's usage and quotas (one tenant, anonymous, without a tokens
 * file): what a "quota near its limit" alert divides. */
static void render_tenants(buf *b)
{
    struct kvd_service *svc = atomic_load(&kvd_metrics_service);
    kvd_auth *a = svc ? kvd_service_auth(svc) : NULL;
    kvd_tenant_usage *u = NULL;
    size_t n = kvd_auth_tenant_usage(a, &u);
    static const char *const what[4][2] = {
        {"tenant_sequences", "sequences each tenant holds"},
        {"tenant_bytes", "K+V payload bytes each tenant holds"},
        {"tenant_max_sequences", "each tenant's sequence quota (0: unlimited)"},
        {"tenant_max_bytes", "each tenant's byte quota (0: unlimited)"},
    };
    for (int w = 0; w < 4 && n; w++) {
        put(b, "# HELP kvdepot_%s %s\n# TYPE kvdepot_%s gauge\n", what[w][0], what[w][1],
            what[w][0]);
        for (size_t i = 0; i < n; i++) {
            char name[300];
            label_value(name, sizeof name, u[i].name);
            const uint64_t v[4] = {u[i].sequences, u[i].bytes, u[i].max_sequences, u[i].max_bytes};
            put(b, "kvdepot_%s{tenant=\"%s\"} %llu\n", what[w][0], name, (unsigned long long)v[w]);
        }
    }
    free(u);
    kvd_auth_unref(a);
}

uint64_t kvd_process_rss(void)
{
    FILE *f = fopen("/proc/self/statm", "r");
    unsigned long long size = 0, resident = 0;
    const int n = f ? fscanf(f, "%llu %llu", &size, &resident) : 0;
    if (f)
        fclose(f);
    const long page = sysconf(_SC_PAGESIZE);
    return n == 2 && page > 0 ? (uint64_t)resident * (uint64_t)page : 0;
}

char *kvd_metrics_render(size_t *len)
{
    buf b = {malloc(16384), 0, 16384, 0};
    if (!b.p)
        return NULL;
    b.p[0] = '\0';
    /* The store's own count wins over the handlers' bookkeeping: it also
     * sees sequences removed by their TTL or by the disk limit. */
    struct kvd_store *store = atomic_load(&kvd_metrics_store);
    kvd_store_stats ss;
    if (store && kvd_store_stats_get(store, &ss) == 0)
        KVD_METRIC_SET(sequences_stored, ss.sequences);
#define KVD__METRIC_RENDER(name, type, help)                                                       \
    put(&b,                                                                                        \
        "# HELP kvdepot_" #name " " help "\n# TYPE kvdepot_" #name " " #type "\n"                  \
        "kvdepot_" #name " %lld\n",                                                                \
        (long long)atomic_load_explicit(&kvd_metrics.name, memory_order_relaxed));
    KVD_METRICS(KVD__METRIC_RENDER)
#undef KVD__METRIC_RENDER

    render_tiers(&b);
    render_process(&b);
    if (store)
        render_rocksdb(&b, store);
    render_tenants(&b);

    put(&b, "# HELP kvdepot_requests_total calls ended, by method and status\n"
            "# TYPE kvdepot_requests_total counter\n");
    for (size_t m = 0; m < MAX_METHODS; m++)
        for (int c = 0; c < NSTATUS; c++) {
            uint64_t n = atomic_load_explicit(&series[m][c].count, memory_order_relaxed);
            /* Every method shows an OK line so dashboards see it from the start. */
            if (n || (c == 0 && m < kvd_methods_count))
                put(&b, "kvdepot_requests_total{method=\"%s\",status=\"%s\"} %llu\n",
                    method_name(m), code_name(c), (unsigned long long)n);
        }
    put(&b, "# HELP kvdepot_request_duration_seconds call latency, by method and status\n"
            "# TYPE kvdepot_request_duration_seconds histogram\n");
    for (size_t m = 0; m < MAX_METHODS; m++)
        for (int c = 0; c < NSTATUS; c++) {
            call_series *s = &series[m][c];
            uint64_t n = atomic_load_explicit(&s->count, memory_order_relaxed);
            if (!n)
                continue;
            const char *mn = method_name(m), *cn = code_name(c);
            uint64_t cum = 0;
            for (size_t k = 0; k < NBUCKETS; k++) {
                cum += atomic_load_explicit(&s->buckets[k], memory_order_relaxed);
                put(&b,
                    "kvdepot_request_duration_seconds_bucket{method=\"%s\",status=\"%s\","
                    "le=\"%g\"} %llu\n",
                    mn, cn, bucket_le[k], (unsigned long long)cum);
            }
            put(&b,
                "kvdepot_request_duration_seconds_bucket{method=\"%s\",status=\"%s\","
                "le=\"+Inf\"} %llu\n"
                "kvdepot_request_duration_seconds_sum{method=\"%s\",status=\"%s\"} %.6f\n"
                "kvdepot_request_duration_seconds_count{method=\"%s\",status=\"%s\"} %llu\n",
                mn, cn, (unsigned long long)n, mn, cn,
                (double)atomic_load_explicit(&s->sum_us, memory_order_relaxed) / 1e6, mn, cn,
                (unsigned long long)n);
        }
    if (b.oom) {
        free(b.p);
        return NULL;
    }
    *len = b.len;
    return b.p;
}

/* ---- HTTP ------------------------------------------------------------------ */

struct kvd_http {
    struct MHD_Daemon *d;
    const atomic_int *ready;
};

static enum MHD_Result reply(struct MHD_Connection *conn, unsigned code, const char *type,
                             char *body, size_t len, int owned)
{
    struct MHD_Response *r = MHD_create_response_from_buffer(
        len, body, owned ? MHD_RESPMEM_MUST_FREE : MHD_RESPMEM_PERSISTENT);
    if (!r) {
        if (owned)
            free(body);
        return MHD_NO;
    }
    MHD_add_response_header(r, "Content-Type", type);
    enum MHD_Result ret = MHD_queue_response(conn, code, r);
    MHD_destroy_response(r);
    return ret;
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *conn, const char *url,
                                  const char *method, const char *version, const char *upload_data,
                                  size_t *upload_data_size, void **req_cls)
{
    (void)version;
    (void)upload_data;
    (void)req_cls;
    kvd_http *h = cls;
    static const char text[] = "text/plain; charset=utf-8";
    if (strcmp(method, "GET") != 0 && strcmp(method, "HEAD") != 0)
        return reply(conn, MHD_HTTP_METHOD_NOT_ALLOWED, text, "only GET\n", 9, 0);
    if (*upload_data_size)
        return MHD_NO;
    if (strcmp(url, "/metrics") == 0) {
        size_t len = 0;
        char *body = kvd_metrics_render(&len);
        if (!body)
            return reply(conn, MHD_HTTP_INTERNAL_SERVER_ERROR, text, "out of memory\n", 14, 0);
        return reply(conn, MHD_HTTP_OK, "text/plain; version=0.0.4; charset=utf-8", body, len, 1);
    }
    if (strcmp(url, "/healthz") == 0)
        return reply(conn, MHD_HTTP_OK, text, "ok\n", 3, 0);
    if (strcmp(url, "/readyz") == 0) {
        if (atomic_load(h->ready) && kvd_service_store_ok(atomic_load(&kvd_metrics_store)))
            return reply(conn, MHD_HTTP_OK, text, "ready\n", 6, 0);
        return reply(conn, MHD_HTTP_SERVICE_UNAVAILABLE, text, "not ready\n", 10, 0);
    }
    return reply(conn, MHD_HTTP_NOT_FOUND, text, "not found: /metrics /healthz /readyz\n", 37, 0);
}

/* "host:port" or "[v6]:port" -> a socket address. */
static int resolve(const char *addr, struct sockaddr_storage *ss, char *err, size_t errlen)
{
    char host[256];
    const char *colon = strrchr(addr, ':');
    if (!colon || colon == addr || !colon[1]) {
        snprintf(err, errlen, "metrics-listen: '%s' is not host:port", addr);
        return -1;
    }
    size_t hl = (size_t)(colon - addr);
    const char *h = addr;
    if (h[0] == '[' && hl >= 2 && h[hl - 1] == ']') {
        h++;
        hl -= 2;
    }
    if (hl >= sizeof host) {
        snprintf(err, errlen, "metrics-listen: host too long");
        return -1;
    }
    memcpy(host, h, hl);
    host[hl] = '\0';
    struct addrinfo hints, *res = NULL;
    memset(&hints, 0, sizeof hints);
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE;
    int e = getaddrinfo(host[0] ? host : NULL, colon + 1, &hints, &res);
    if (e != 0 || !res) {
        snprintf(err, errlen, "metrics-listen: cannot resolve '%s': %s", addr, gai_strerror(e));
        return -1;
    }
    memcpy(ss, res->ai_addr, res->ai_addrlen);
    freeaddrinfo(res);
    return 0;
}

int kvd_http_start(const char *addr, const atomic_int *ready, kvd_http **out, int *port, char *err,
                   size_t errlen)
{
    *out = NULL;
    struct sockaddr_storage ss;
    memset(&ss, 0, sizeof ss);
    if (resolve(addr, &ss, err, errlen) != 0)
        return -2;
    kvd_http *h = calloc(1, sizeof *h);
    if (!h) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    h->ready = ready;
    unsigned flags = MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_POLL;
    if (ss.ss_family == AF_INET6)
        flags |= MHD_USE_IPv6;
    /* One internal thread is plenty for scrapes and probes; the port in
     * MHD_start_daemon is ignored in favour of the address given. */
    h->d = MHD_start_daemon(flags, 0, NULL, NULL, on_request, h, MHD_OPTION_SOCK_ADDR,
                            (struct sockaddr *)&ss, MHD_OPTION_CONNECTION_TIMEOUT, 10u,
                            MHD_OPTION_END);
    if (!h->d) {
        snprintf(err, errlen, "cannot serve metrics on %s (address in use or not valid)", addr);
        free(h);
        return -1;
    }
    const union MHD_DaemonInfo *info = MHD_get_daemon_info(h->d, MHD_DAEMON_INFO_BIND_PORT);
    *port = info ? (int)info->port : 0;
    *out = h;
    return 0;
}

void kvd_http_stop(kvd_http *h)
{
    if (!h)
        return;
    MHD_stop_daemon(h->d);
    free(h);
}

int kvd_http_listen_fd(const kvd_http *h)
{
    if (!h)
        return -1;
    const union MHD_DaemonInfo *info = MHD_get_daemon_info(h->d, MHD_DAEMON_INFO_LISTEN_FD);
    return info ? (int)info->listen_fd : -1;
}
