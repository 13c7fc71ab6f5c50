/*
 * kvdepotd: settings, store, server, and the wait for SIGTERM/SIGINT.
 *
 * Signals are blocked in every thread (the mask is set before gRPC or the
 * store start theirs) and read synchronously from a signalfd by the main
 * thread, so shutdown work and the SIGHUP reload of the tokens file never
 * run inside a signal handler.
 */
#include <errno.h>
#include <malloc.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sys/stat.h>
#include <unistd.h>

#include <grpc/grpc.h>
#include <grpc/support/log.h>

#include "auth.h"
#include "config.h"
#include "conncap.h"
#include "log.h"
#include "metrics.h"
#include "rpc.h"
#include "server.h"
#include "store.h"

#ifndef KVD_VERSION
#define KVD_VERSION "unknown"
#endif

static int write_port_file(const char *path, int port)
{
    char tmp[4096];
    if ((size_t)snprintf(tmp, sizeof tmp, "%s.tmp.%ld", path, (long)getpid()) >= sizeof tmp)
        return -1;
    FILE *f = fopen(tmp, "w");
    if (!f)
        return -1;
    int ok = fprintf(f, "%d\n", port) > 0;
    ok = (fclose(f) == 0) && ok;
    /* rename makes the file appear complete or not at all. */
    if (!ok || rename(tmp, path) != 0) {
        unlink(tmp);
        return -1;
    }
    return 0;
}

/* Legal but worth a word: bearer tokens over plaintext that leaves the
 * machine, and a tokens file other users can read. */
static void warn_exposed_secrets(const kvd_config *cfg)
{
    if (!cfg->tokens_file)
        return;
    if (!cfg->tls_cert && !kvd_listen_is_loopback(cfg->listen))
        KVD_LOG(KVD_LOG_WARN, "bearer tokens will cross the network in plaintext",
                "hint=\"give --tls-cert and --tls-key\"");
    struct stat sb;
    if (stat(cfg->tokens_file, &sb) == 0 && (sb.st_mode & S_IROTH))
        KVD_LOG(KVD_LOG_WARN, "the tokens file is readable by every user",
                "hint=\"chmod o-r the tokens file\"");
}

/* The metrics address cannot be bound: kvdepotd stops there (a server
 * that cannot be scraped or probed is not one to run blind), unless the
 * operator said the endpoint is optional. Returns 1 to go on. */
static int metrics_unbound(const kvd_config *cfg, const char *err)
{
    if (!cfg->metrics_optional)
        return 0;
    KVD_LOG(KVD_LOG_WARN, err, "metrics=off hint=\"--metrics-optional is set\"");
    return 1;
}

/* SIGHUP: read the tokens file again and count usage for the new table;
 * calls in flight keep the table they started with. A file that does not
 * load leaves the old table in place. */
static void reload_tokens(kvd_service *svc)
{
    const kvd_config *cfg = svc->cfg;
    if (!cfg->tokens_file) {
        KVD_LOG(KVD_LOG_INFO, "SIGHUP: no tokens file to reload", "reload=skipped");
        return;
    }
    char err[512];
    kvd_auth *a = NULL;
    if (kvd_auth_load(cfg->tokens_file, cfg->tenant_max_sequences, cfg->tenant_max_bytes, &a,
                      err, sizeof err) != 0) {
        KVD_LOG(KVD_LOG_ERROR, err, "reload=failed");
        return;
    }
    kvd_error serr;
    kvd_error_clear(&serr);
    if (kvd_auth_scan(a, svc->store, NULL, &serr) != 0) {
        KVD_LOG(KVD_LOG_ERROR, serr.msg, "reload=failed");
        kvd_auth_unref(a);
        return;
    }
    pthread_mutex_lock(&svc->auth_mu);
    kvd_auth *old = svc->auth;
    svc->auth = a;
    pthread_mutex_unlock(&svc->auth_mu);
    kvd_auth_unref(old);
    KVD_METRIC_ADD(tokens_reloads_total, 1);
    KVD_LOG(KVD_LOG_INFO, "tokens file reloaded", "tokens=%zu tenants=%zu", a->n_tokens,
            a->n_tenants);
}

/*
 * The memory tiers' sizes into o: those configured, or chosen for the
 * machine and the GPU that serves ("auto": kvd_config_tiers, from the
 * memory this process may use and the GPU's free memory); the start-up log
 * says which.
 */
static void size_tiers(const kvd_config *cfg, kvd_backend *device, kvd_store_options *o)
{
    kvd_backend_desc d;
    memset(&d, 0, sizeof d);
    if (device)
        kvd_backend_describe(device, &d);
    const uint64_t mem = kvd_machine_memory("/sys/fs/cgroup");
    const uint64_t gpu_free = !device ? 0 : d.free_bytes ? d.free_bytes : d.memory_bytes / 2;
    kvd_config_tiers(cfg, mem, gpu_free, &o->device_tier_bytes, &o->host_tier_bytes);
    o->append_memory_bytes = kvd_config_append_memory(cfg, mem);
    KVD_LOG(KVD_LOG_INFO, "memory tiers",
            "device_tier_bytes=%llu device_tier=%s host_tier_bytes=%llu host_tier=%s "
            "append_memory_bytes=%llu append_memory=%s memory_bytes=%llu gpu_free_bytes=%llu",
            (unsigned long long)o->device_tier_bytes,
            cfg->device_tier_bytes == KVD_CONFIG_AUTO ? "auto" : "set",
            (unsigned long long)o->host_tier_bytes,
            cfg->host_tier_bytes == KVD_CONFIG_AUTO ? "auto" : "set",
            (unsigned long long)o->append_memory_bytes,
            cfg->append_memory_bytes == KVD_CONFIG_AUTO ? "auto" : "set", (unsigned long long)mem,
            (unsigned long long)gpu_free);
}

/*
 * The compute backends of the process, created once: the CPU backend with
 * every CPU this process may use (it codes pages and is the reference and
 * fallback of every op), and, per --device, a CUDA device whose memory holds
 * the device tier and attends the pages that lie there (*dev; NULL when the
 * CPU serves). NULL (with err set) when a backend that was asked for cannot
 * be created.
 */
static kvd_backend *open_backends(int cuda, int index, int threads, int bg_nice, kvd_backend **dev,
                                  kvd_error *err)
{
    kvd_backend *cpu = NULL;
    *dev = NULL;
    /* All requests together compute on one thread more than the machine
     * (its cgroup quota included) has CPUs, whatever one op may use. */
    kvd_cpu_options opt = {threads, 0, (int)kvd_machine_cpus("/sys/fs/cgroup") + 1, bg_nice};
    if (kvd_backend_cpu_create(&opt, &cpu, err) != 0)
        return NULL;
    kvd_error cerr;
    kvd_error_clear(&cerr);
    int crc = cuda >= 0 ? kvd_backend_cuda_create(index, dev, &cerr) : KVD_EUNAVAIL;
    if (crc != 0 && cuda > 0) {
        kvd_error_set(err, crc, "--device asks for a CUDA device and none is usable: %s", cerr.msg);
        kvd_backend_free(cpu);
        return NULL;
    }
    if (*dev) {
        kvd_backend_desc d;
        kvd_backend_describe(*dev, &d);
        KVD_LOG(KVD_LOG_INFO, "compute backend: pages are held and attended on the GPU",
                "backend=cuda device=\"%s\" device_memory_bytes=%llu cpu_threads=%d", d.device,
                (unsigned long long)d.memory_bytes, cpu->nthreads);
    } else {
        KVD_LOG(KVD_LOG_INFO, "compute backend: pages are held and attended on the CPU",
                "backend=cpu threads=%d cuda=\"%s\"", cpu->nthreads,
                cuda < 0             ? "not asked for (--device cpu)"
                : crc == KVD_EUNSUPP ? "not in this build"
                                     : cerr.msg);
    }
    return cpu;
}

/* Stored caches are private to the service: warn when the data directory
 * of an earlier start lets other users in (new ones are made 0700). */
static void check_data_dir_mode(const char *dir)
{
    struct stat st;
    if (stat(dir, &st) == 0 && (st.st_mode & 077)) {
        char q[1100];
        kvd_log_quote(q, sizeof q, dir, strlen(dir));
        KVD_LOG(KVD_LOG_WARN, "the data directory is open to other users: chmod 700 it",
                "data_dir=%s mode=%03o", q, (unsigned)(st.st_mode & 0777));
    }
}

/* gRPC's own log lines go through kvdepotd's log. One of them matters: the
 * gRPC core (1.51) stops listening for good when accept4 fails (descriptors
 * exhausted: "Failed accept4"), so no new connection would ever be served;
 * the main loop then stops kvdepotd (exit 1) so that a restart listens
 * again. */
static _Atomic int listener_dead;

static void grpc_log(gpr_log_func_args *a)
{
    const char *file = a->file ? a->file : "";
    const char *msg = a->message ? a->message : "";
    if (strstr(file, "tcp_server") && strstr(msg, "Failed accept4"))
        atomic_store(&listener_dead, 1);
    int level = a->severity == GPR_LOG_SEVERITY_ERROR  ? KVD_LOG_ERROR
                : a->severity == GPR_LOG_SEVERITY_INFO ? KVD_LOG_INFO
                                                       : KVD_LOG_DEBUG;
    const char *base = strrchr(file, '/') ? strrchr(file, '/') + 1 : file;
    KVD_LOG(level, msg, "grpc=%s:%d", base, a->line);
}

/* Connections, RocksDB's files and the store's threads all take
 * descriptors, and RocksDB cannot write without them: the soft limit is
 * raised to the hard one at start, and the log says what it is. Returns
 * the limit (an unlimited one counts as 2^22). */
static uint64_t raise_nofile(void)
{
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) != 0)
        return 1024;
    rlim_t was = rl.rlim_cur;
    if (rl.rlim_cur < rl.rlim_max) {
        rl.rlim_cur = rl.rlim_max;
        if (setrlimit(RLIMIT_NOFILE, &rl) != 0)
            rl.rlim_cur = was;
    }
    KVD_LOG(rl.rlim_cur < 4096 ? KVD_LOG_WARN : KVD_LOG_INFO,
            rl.rlim_cur < 4096 ? "descriptor limit below 4096: raise the hard limit (ulimit -Hn)"
                               : "descriptor limit",
            "nofile=%llu was=%llu hard=%llu", (unsigned long long)rl.rlim_cur,
            (unsigned long long)was, (unsigned long long)rl.rlim_max);
    return rl.rlim_cur == RLIM_INFINITY || rl.rlim_cur > (1u << 22) ? 1u << 22
                                                                    : (uint64_t)rl.rlim_cur;
}

/* Connections are capped so that a flood of them cannot take the
 * descriptors RocksDB needs (conncap.h), and RocksDB's own open files are
 * bounded by half of what is kept back for it. */
static uint64_t size_connections(const kvd_config *cfg, uint64_t nofile, kvd_store_options *sopt)
{
    uint64_t reserve = kvd_conncap_reserve(nofile);
    uint64_t fit = kvd_conncap_default(nofile);
    uint64_t max = cfg->max_connections ? cfg->max_connections : fit;
    sopt->max_open_files = (uint32_t)(reserve / 2 > UINT32_MAX ? UINT32_MAX : reserve / 2);
    KVD_LOG(max > fit ? KVD_LOG_WARN : KVD_LOG_INFO,
            max > fit ? "max-connections leaves RocksDB fewer descriptors than it is kept"
                      : "connections capped",
            "max_connections=%llu nofile=%llu rocksdb_max_open_files=%u", (unsigned long long)max,
            (unsigned long long)nofile, sopt->max_open_files);
    return max;
}

int main(int argc, char **argv)
{
    /* Every file kvdepotd creates (RocksDB's, the port file) is 0600 and
     * every directory 0700: the stored K/V is nobody else's to read. */
    umask(077);
    const char *prog = strrchr(argv[0], '/') ? strrchr(argv[0], '/') + 1 : argv[0];
    kvd_config cfg;
    char err[512];
    if (kvd_config_defaults(&cfg) != 0) {
        fprintf(stderr, "%s: out of memory\n", prog);
        return 1;
    }
    int action = KVD_CONFIG_RUN;
    /* `kvdepotd repair [settings]`: repair the store in data-dir, then exit.
     * `kvdepotd restore BACKUP [settings]`: copy a backup into data-dir. */
    const int repair = argc > 1 && strcmp(argv[1], "repair") == 0;
    const int restore = argc > 1 && strcmp(argv[1], "restore") == 0;
    const char *backup = NULL;
    if (restore) {
        if (argc < 3 || argv[2][0] == '-') {
            fprintf(stderr, "%s: usage: %s restore BACKUP --data-dir DIR\n", prog, prog);
            kvd_config_free(&cfg);
            return 2;
        }
        backup = argv[2];
        argv[2] = argv[0];
        argv += 2;
        argc -= 2;
    } else if (repair) {
        argv[1] = argv[0];
        argv++;
        argc--;
    }
    if (kvd_config_load(&cfg, argc, argv, getenv, &action, err, sizeof err) != 0) {
        fprintf(stderr, "%s: %s\n", prog, err);
        kvd_config_free(&cfg);
        return 2;
    }
    if (action == KVD_CONFIG_PRINT) {
        kvd_config_print(stdout, &cfg);
        kvd_config_free(&cfg);
        return 0;
    }
    if (action == KVD_CONFIG_HELP) {
        kvd_config_usage(stdout, prog);
        kvd_config_free(&cfg);
        return 0;
    }
    if (action == KVD_CONFIG_VERSION) {
        printf("kvdepotd %s\n", KVD_VERSION);
        kvd_config_free(&cfg);
        return 0;
    }
    kvd_log_json = strcmp(cfg.log_format, "json") == 0;
    if ((repair || restore) && action == KVD_CONFIG_RUN) {
        kvd_log_threshold = cfg.log_level;
        int rc = repair ? kvd_repair_run(&cfg, prog) : kvd_restore_run(&cfg, backup, prog);
        kvd_config_free(&cfg);
        return rc;
    }
    /* Compute: one pool of as many threads as the CPUs the process may use
     * (its cgroup's quota included). Workers: four per compute thread, at
     * least 16, so that long calls share the CPUs with short ones instead
     * of making them queue (Attend of 1 query x 4K tokens behind 8 x 32K:
     * p99 20x its p50 with a worker per CPU, 2x with 16). */
    if (cfg.compute_threads == 0)
        cfg.compute_threads = kvd_machine_cpus("/sys/fs/cgroup");
    if (cfg.threads == 0)
        cfg.threads = 4 * cfg.compute_threads < 16    ? 16
                      : 4 * cfg.compute_threads > 256 ? 256
                                                      : 4 * cfg.compute_threads;
    /* One malloc arena per compute thread rather than per worker: freed
     * append and read buffers are reused instead of each worker's arena
     * keeping its own (RSS after storing 1 GiB with 16 MiB tiers: 240 MB
     * instead of 350-400). */
    mallopt(M_ARENA_MAX, (int)cfg.compute_threads);
    kvd_log_threshold = cfg.log_level;
    /* Configuration mistakes are found before anything starts (exit 2); the
     * tokens file is read now for the same reason. */
    kvd_auth *auth = NULL;
    if (kvd_server_check_security(&cfg, err, sizeof err) != 0 ||
        kvd_auth_load(cfg.tokens_file, cfg.tenant_max_sequences, cfg.tenant_max_bytes, &auth,
                      err, sizeof err) != 0) {
        fprintf(stderr, "%s: %s\n", prog, err);
        kvd_config_free(&cfg);
        return 2;
    }
    warn_exposed_secrets(&cfg);

    sigset_t mask;
    sigemptyset(&mask);
    sigaddset(&mask, SIGTERM);
    sigaddset(&mask, SIGINT);
    sigaddset(&mask, SIGHUP);
    pthread_sigmask(SIG_BLOCK, &mask, NULL);
    signal(SIGPIPE, SIG_IGN);
    int sfd = signalfd(-1, &mask, SFD_CLOEXEC);
    if (sfd < 0) {
        fprintf(stderr, "%s: signalfd: %s\n", prog, strerror(errno));
        kvd_auth_unref(auth);
        kvd_config_free(&cfg);
        return 1;
    }

    /* Probes answer while the store opens: alive, not ready. */
    kvd_service svc = {.cfg = &cfg, .auth = auth};
    atomic_init(&svc.serving, 0);
    pthread_mutex_init(&svc.auth_mu, NULL);
    kvd_http *http = NULL;
    int metrics_port = 0;
    int hrc = cfg.metrics_listen ? kvd_http_start(cfg.metrics_listen, &svc.serving, &http,
                                                  &metrics_port, err, sizeof err)
                                 : 0;
    if (hrc == -2 || (hrc && !metrics_unbound(&cfg, err))) {
        fprintf(stderr, "%s: %s%s\n", prog, err,
                hrc == -2 ? ""
                          : " (choose another --metrics-listen, port 0 for a free one, an empty "
                            "one for none, or --metrics-optional to start without it)");
        kvd_auth_unref(auth);
        close(sfd);
        kvd_config_free(&cfg);
        return 1;
    }

    kvd_store_options sopt = {
        .data_dir = cfg.data_dir,
        .page_tokens = (uint32_t)cfg.page_tokens,
        .sync_writes = cfg.sync,
        .max_seq_tokens = cfg.max_tokens_per_sequence,
        .device_tier_bytes = cfg.device_tier_bytes,
        .host_tier_bytes = cfg.host_tier_bytes,
        .disk_bytes = cfg.disk_bytes,
        .prefetch_pages = (uint32_t)cfg.prefetch_pages,
    };
    /* the string settings were checked as they were set (kvd_config_set) */
    int mode = 1, dev_cuda = 0, dev_index = -1, background = KVD_CPU_BACKGROUND_IDLE;
    kvd_config_parse_durability(cfg.durability, &mode);
    sopt.durability = mode == 0   ? KVD_DURABILITY_NONE
                      : mode == 2 ? KVD_DURABILITY_SYNC
                                  : KVD_DURABILITY_SPILL;
    sopt.wal_point_in_time = strcmp(cfg.wal_recovery, "point-in-time") == 0;
    kvd_config_parse_device(cfg.device, &dev_cuda, &dev_index);
    kvd_config_parse_background(cfg.background_priority, &background); /* --background-priority */
    if (cfg.sync && sopt.durability == KVD_DURABILITY_NONE) {
        fprintf(stderr, "%s: --sync contradicts --durability none\n", prog);
        kvd_http_stop(http);
        kvd_auth_unref(auth);
        close(sfd);
        kvd_config_free(&cfg);
        return 2;
    }
    /* The compute backends: the CPU codes pages, trains PQ centroids and
     * runs search; a CUDA device, when one serves, holds the device tier and
     * attends the pages in it. */
    kvd_store *store = NULL;
    kvd_error serr;
    kvd_error_clear(&serr);
    check_data_dir_mode(cfg.data_dir);
    uint64_t nofile = raise_nofile();
    uint64_t max_connections = size_connections(&cfg, nofile, &sopt);
    kvd_backend *device = NULL;
    kvd_backend *backend =
        open_backends(dev_cuda, dev_index, (int)cfg.compute_threads, background, &device, &serr);
    int rc = backend ? 0 : KVD_EINTERNAL;
    if (rc)
        fprintf(stderr, "%s: no compute backend: %s\n", prog, serr.msg);
    sopt.backend = backend;
    sopt.device = device;
    if (rc == 0)
        size_tiers(&cfg, device, &sopt);
    if (rc == 0 && (rc = kvd_store_open(&sopt, &store, &serr)) != 0) {
        fprintf(stderr, "%s: cannot open the store in %s: %s\n", prog, cfg.data_dir,
                serr.msg[0] ? serr.msg : kvd_strerror(rc));
        /* A damaged table or MANIFEST (the WAL's message has its own way). */
        if ((rc == KVD_ECORRUPT || strstr(serr.msg, "Corruption")) &&
            !strstr(serr.msg, "wal-recovery") && !strstr(serr.msg, "kvdepotd repair"))
            fprintf(stderr,
                    "%s: the store's files are damaged: back up %s, then run `%s repair "
                    "--data-dir %s` (README, \"A damaged store\")\n",
                    prog, cfg.data_dir, prog, cfg.data_dir);
    }
    if (rc) {
        kvd_backend_free(backend);
        kvd_backend_free(device);
        kvd_http_stop(http);
        kvd_auth_unref(auth);
        close(sfd);
        kvd_config_free(&cfg);
        return 1;
    }
    /* isa-l: RocksDB's checksums computed in hardware (store/crc32c.c) */
    KVD_LOG(KVD_LOG_INFO, "store checksums", "crc32c=%s", kvd_store_crc32c());
    if (kvd_store_recovery_report(store)[0])
        KVD_LOG(KVD_LOG_WARN,
                "wal-recovery point-in-time dropped a damaged part of the write-ahead log: "
                "appends acknowledged after it are gone",
                "dropped=\"%.900s\"", kvd_store_recovery_report(store));
    const kvd_recovery_loss *loss;
    size_t nloss = kvd_store_recovery_losses(store, &loss);
    for (size_t i = 0; i < nloss; i++) {
        static const char *what[] = {"", "came back with fewer tokens than were acknowledged",
                                     "was created after the damage: it is gone with its tokens",
                                     "was deleted after the damage: it is back",
                                     "lost an acknowledged write (its record was unreadable)"};
        char id[4 * KVD_SEQ_ID_MAX + 3];
        kvd_log_quote(id, sizeof id, (const char *)loss[i].id, loss[i].id_len);
        KVD_LOG(KVD_LOG_WARN, "a sequence lost acknowledged writes to the damaged write-ahead log",
                "sequence=%s loss=\"%s\" acknowledged_tokens=%llu recovered_tokens=%llu", id,
                what[loss[i].kind], (unsigned long long)loss[i].acknowledged,
                (unsigned long long)loss[i].recovered);
    }
    svc.store = store;
    kvd_metrics_store = store;
    kvd_metrics_service = &svc;
    svc.page_tokens = kvd_store_page_tokens(store);
    kvd_store_totals tot;
    if ((rc = kvd_auth_scan(auth, store, &tot, &serr)) != 0) {
        fprintf(stderr, "%s: cannot count what the store holds: %s\n", prog, serr.msg);
        kvd_store_close(store);
        kvd_backend_free(backend);
        kvd_backend_free(device);
        kvd_http_stop(http);
        kvd_auth_unref(auth);
        close(sfd);
        kvd_config_free(&cfg);
        return 1;
    }
    KVD_METRIC_SET(sequences_stored, tot.sequences);
    KVD_METRIC_SET(payload_bytes_stored, tot.payload_bytes);
    KVD_METRIC_SET(stored_bytes, tot.stored_bytes);
    KVD_METRIC_SET(pages_sealed, tot.sealed_pages);

    gpr_set_log_function(grpc_log);
    grpc_init();
    kvd_server *srv = NULL;
    int port = 0;
    if (kvd_conncap_start(max_connections, nofile, kvd_http_listen_fd(http)) != 0)
        KVD_LOG(KVD_LOG_WARN, "out of memory: connections are not capped", NULL);
    if (kvd_server_start(&svc, &srv, &port, err, sizeof err) != 0) {
        fprintf(stderr, "%s: %s\n", prog, err);
        kvd_store_close(store);
        kvd_backend_free(backend);
        kvd_backend_free(device);
        grpc_shutdown();
        kvd_http_stop(http);
        kvd_auth_unref(auth);
        close(sfd);
        kvd_config_free(&cfg);
        return 1;
    }
    int exit_code = 0;
    atomic_store(&svc.serving, 1);
    KVD_METRIC_SET(ready, 1);
    if (cfg.port_file && write_port_file(cfg.port_file, port) != 0) {
        fprintf(stderr, "%s: cannot write the port file %s: %s\n", prog, cfg.port_file,
                strerror(errno));
        exit_code = 1;
    } else {
        char qlisten[300], qdir[1100];
        kvd_log_quote(qlisten, sizeof qlisten, cfg.listen, strlen(cfg.listen));
        kvd_log_quote(qdir, sizeof qdir, cfg.data_dir, strlen(cfg.data_dir));
        KVD_LOG(KVD_LOG_INFO, "serving",
                "listen=%s port=%d data_dir=%s threads=%llu background_priority=%s page_tokens=%u "
                "durability=%s max_message_bytes=%llu tls=%s auth=%s metrics_port=%d version=%s "
                "store_format=%d",
                qlisten, port, qdir, (unsigned long long)cfg.threads, cfg.background_priority,
                svc.page_tokens, cfg.sync ? "sync" : cfg.durability,
                (unsigned long long)cfg.max_message_bytes,
                !cfg.tls_cert       ? "off"
                : cfg.tls_client_ca ? "mtls"
                                    : "on",
                cfg.tokens_file ? "tokens" : "off", metrics_port, KVD_VERSION, KVD_STORE_FORMAT);
        for (;;) {
            /* Once a second, or at a signal: a listener that stopped
             * accepting (grpc_log) or a store that cannot write any more
             * (RocksDB's flush failed: no descriptor, no space) does not come
             * back in this process, while a restart listens again and
             * recovers every acknowledged write from the WAL: stop, exit 1,
             * and let the supervisor restart kvdepotd. */
            struct pollfd pfd = {sfd, POLLIN, 0};
            if (poll(&pfd, 1, 1000) == 0) {
                if (atomic_load(&listener_dead)) {
                    KVD_LOG(KVD_LOG_ERROR,
                            "the listener stopped accepting connections (accept4 failed: "
                            "descriptors exhausted): stopping so that a restart listens again",
                            NULL);
                    exit_code = 1;
                    break;
                }
                const char *why = kvd_store_broken(store);
                if (why) {
                    char q[600];
                    kvd_log_quote(q, sizeof q, why, strlen(why));
                    KVD_LOG(KVD_LOG_ERROR,
                            "the store cannot write any more: stopping so that a restart "
                            "recovers it (acknowledged writes are in the WAL)",
                            "error=%s", q);
                    exit_code = 1;
                    break;
                }
                continue;
            }
            struct signalfd_siginfo si;
            ssize_t n = read(sfd, &si, sizeof si);
            if (n == (ssize_t)sizeof si && si.ssi_signo == SIGHUP) {
                reload_tokens(&svc);
                continue;
            }
            if (n == (ssize_t)sizeof si) {
                KVD_LOG(KVD_LOG_INFO, "shutting down", "signal=%s",
                        si.ssi_signo == SIGTERM ? "SIGTERM" : "SIGINT");
                break;
            }
            if (n < 0 && errno != EINTR) {
                KVD_LOG(KVD_LOG_ERROR, "reading the signalfd failed", "errno=%d", errno);
                exit_code = 1;
                break;
            }
        }
    }

    atomic_store(&svc.serving, 0);
    KVD_METRIC_SET(ready, 0);
    kvd_server_shutdown(srv, cfg.shutdown_grace_ms);
    kvd_metrics_store = NULL;
    kvd_metrics_service = NULL;
    kvd_store_close(store);
    kvd_backend_free(backend);
    kvd_backend_free(device);
    grpc_shutdown();
    kvd_http_stop(http);
    kvd_auth_unref(svc.auth);
    pthread_mutex_destroy(&svc.auth_mu);
    close(sfd);
    KVD_LOG(KVD_LOG_INFO, "stopped", "exit=%d", exit_code);
    kvd_config_free(&cfg);
    return exit_code;
}
