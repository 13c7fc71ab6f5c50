#include "config.h"

#include <ctype.h>
#include <errno.h>
#include <sched.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include <yaml.h>

enum setting_type {
    T_STRING,    /* char *, malloc'd */
    T_OPTSTRING, /* char *, empty value = unset (NULL) */
    T_UINT,      /* uint64_t, decimal */
    T_SIZE,      /* uint64_t, bytes with optional K/M/G/T suffix (powers of 1024) */
    T_SIZE_AUTO, /* a T_SIZE, or "auto" (KVD_CONFIG_AUTO: sized at start) */
    T_BOOL,      /* int 0/1; a bare flag means true */
    T_LOGLEVEL,  /* int, kvd_log_level */
};

typedef struct setting {
    const char *name;    /* flag name without "--"; also the config-file key */
    enum setting_type type;
    size_t offset;       /* field in kvd_config */
    const char *def;     /* default in text form, parsed like user input */
    uint64_t min, max;   /* inclusive bounds for T_UINT / T_SIZE */
    const char *metavar; /* shown in --help */
    const char *help;
} setting;

#define F(field) offsetof(kvd_config, field)
#define MiB (1024ull * 1024)
#define GiB (1024ull * MiB)

/* The one table. Defaults are text so that they go through the same parser
 * and bounds checks as every user-supplied value. */
static const setting settings[] = {
    {"listen", T_STRING, F(listen), "127.0.0.1:50051", 0, 0, "ADDR",
     "address to serve on, host:port (port 0 picks a free port; see --port-file)"},
    {"data-dir", T_STRING, F(data_dir), "./kvdepot-data", 0, 0, "DIR",
     "directory of the RocksDB store; created if missing"},
    {"threads", T_UINT, F(threads), "0", 0, 256, "N",
     "worker threads, each with its own completion queue (0 = 4 per compute thread, at least "
     "16: long calls share the CPUs with short ones instead of making them wait)"},
    {"compute-threads", T_UINT, F(compute_threads), "0", 0, 256, "N",
     "threads that compute (attention, search) at once, one pool shared by every request; "
     "a request alone uses them all (0 = the CPUs the process may use, its cgroup's CPU quota "
     "when lower; 1 = each request on its own worker thread)"},
    {"background-priority", T_STRING, F(background_priority), "idle", 0, 0, "P",
     "while other requests compute, a long one (beyond 20 ms of computing) computes on "
     "background threads of lower priority, so that the OS too runs the short ones first: idle "
     "(SCHED_IDLE: any other thread of kvdepotd takes their CPU at once), 1..19 (a nice value "
     "that much above kvdepotd's) or off (long requests compute on their own threads). Both weigh "
     "within kvdepotd's cgroup or session only: use off where busy processes share them"},
    {"page-tokens", T_UINT, F(page_tokens), "0", 0, 65536, "N",
     "tokens per page of a new data directory (0 = 256); an existing directory keeps its own "
     "and refuses a different non-zero value"},
    {"sync", T_BOOL, F(sync), "false", 0, 0, "BOOL",
     "same as --durability sync (kept for existing configurations)"},
    {"max-message-bytes", T_SIZE, F(max_message_bytes), "8MiB", 64 * 1024, 2 * GiB - 1, "SIZE",
     "largest gRPC message received or sent (applies to every call)"},
    {"max-append-bytes", T_SIZE, F(max_append_bytes), "2GiB", 1, 1ull << 50, "SIZE",
     "largest K+V payload of one Append; larger appends fail with RESOURCE_EXHAUSTED"},
    {"log-level", T_LOGLEVEL, F(log_level), "info", 0, 0, "LEVEL",
     "debug (one line per request), info, warn (every failed request) or error"},
    {"log-format", T_STRING, F(log_format), "logfmt", 0, 0, "FORMAT",
     "logfmt (key=value, one line per event) or json (one object per line; gRPC's own "
     "messages too)"},
    {"port-file", T_OPTSTRING, F(port_file), "", 0, 0, "FILE",
     "once serving, write the bound port and a newline to FILE (atomically)"},
    {"shutdown-grace-ms", T_UINT, F(shutdown_grace_ms), "2000", 0, 600000, "MS",
     "on SIGTERM/SIGINT, time in-flight calls get before they are cancelled"},
    {"config", T_OPTSTRING, F(config), "", 0, 0, "FILE",
     "YAML config file (keys are these option names); flags and KVDEPOT_* win over it"},
    {"tls-cert", T_OPTSTRING, F(tls_cert), "", 0, 0, "FILE",
     "PEM certificate chain of the listener; with --tls-key turns TLS on"},
    {"tls-key", T_OPTSTRING, F(tls_key), "", 0, 0, "FILE", "PEM private key of --tls-cert"},
    {"tls-client-ca", T_OPTSTRING, F(tls_client_ca), "", 0, 0, "FILE",
     "PEM CA bundle; when set, clients must present a certificate it signed (mTLS)"},
    {"insecure", T_BOOL, F(insecure), "false", 0, 0, "BOOL",
     "serve plaintext (no TLS); without a certificate this is what happens on loopback"},
    {"allow-insecure-remote", T_BOOL, F(allow_insecure_remote), "false", 0, 0, "BOOL",
     "with --insecure, allow plaintext on a non-loopback address"},
    {"tokens-file", T_OPTSTRING, F(tokens_file), "", 0, 0, "FILE",
     "YAML file of bearer tokens (tenant, namespaces, access); reread on SIGHUP. "
     "None = no authentication"},
    {"max-tokens-per-sequence", T_UINT, F(max_tokens_per_sequence), "0", 0, 1ull << 40, "N",
     "most tokens a sequence may hold (0 = unlimited); beyond -> RESOURCE_EXHAUSTED"},
    {"tenant-max-sequences", T_UINT, F(tenant_max_sequences), "0", 0, 1ull << 40, "N",
     "sequences each tenant may hold (0 = unlimited; the tokens file may override)"},
    {"tenant-max-bytes", T_SIZE, F(tenant_max_bytes), "0", 0, 1ull << 60, "SIZE",
     "K+V payload bytes each tenant may hold (0 = unlimited; the tokens file may override)"},
    {"max-concurrent-streams", T_UINT, F(max_concurrent_streams), "256", 1, 1u << 20, "N",
     "concurrent calls per client connection (HTTP/2 streams)"},
    {"keepalive-time-ms", T_UINT, F(keepalive_time_ms), "60000", 1000, 1ull << 31, "MS",
     "ping an idle connection after this long"},
    {"keepalive-timeout-ms", T_UINT, F(keepalive_timeout_ms), "20000", 1000, 1ull << 31, "MS",
     "close the connection when a ping is not answered within this time"},
    {"keepalive-min-ping-interval-ms", T_UINT, F(keepalive_min_ping_interval_ms), "10000", 0,
     1ull << 31, "MS", "clients pinging more often than this are told to go away"},
    {"handshake-timeout-ms", T_UINT, F(handshake_timeout_ms), "10000", 100, 600000, "MS",
     "close a connection that has not completed its TLS handshake and sent its HTTP/2 "
     "settings within this time"},
    {"max-connections", T_UINT, F(max_connections), "0", 0, 1ull << 24, "N",
     "client connections held open at most (more are reset when accepted); 0: the descriptor "
     "limit less a quarter of it (at least 64) kept for RocksDB's files"},
    {"keepalive-permit-without-calls", T_BOOL, F(keepalive_permit_without_calls), "true", 0, 0,
     "BOOL", "accept (and send) keepalive pings on connections with no call in flight"},
    {"metrics-listen", T_OPTSTRING, F(metrics_listen), "127.0.0.1:9464", 0, 0, "ADDR",
     "HTTP address of /metrics, /healthz, /readyz (port 0 = free port; empty = off); "
     "kvdepotd does not start when it cannot bind it, unless --metrics-optional"},
    {"metrics-optional", T_BOOL, F(metrics_optional), "false", 0, 0, "BOOL",
     "start without the HTTP endpoint (a warning) when --metrics-listen cannot be bound"},
    {"durability", T_STRING, F(durability), "spill", 0, 0, "MODE",
     "none (pure cache: no WAL, the disk limit drops LRU sequences), spill (appends reach "
     "RocksDB before the reply, WAL not fsynced) or sync (WAL fsynced before the reply)"},
    {"wal-recovery", T_STRING, F(wal_recovery), "strict", 0, 0, "MODE",
     "strict (a damaged write-ahead log stops the start, naming the file) or point-in-time "
     "(keep what precedes the damage, drop the rest, log what was dropped)"},
    {"device", T_STRING, F(device), "auto", 0, 0, "DEV",
     "where pages are held and attended: auto (the first CUDA device when one is usable, "
     "else the CPU), cpu, cuda or cuda:N (that device; no fallback)"},
    {"device-tier-bytes", T_SIZE_AUTO, F(device_tier_bytes), "auto", 0, 1ull << 50, "SIZE",
     "page pool in the device's memory (host memory when --device resolves to the CPU), "
     "allocated once at start; 0 = no device tier; auto = the GPU's free memory less "
     "max(1GiB, 1/8 of it), or 1/8 of the machine's memory on the CPU"},
    {"host-tier-bytes", T_SIZE_AUTO, F(host_tier_bytes), "auto", 0, 1ull << 50, "SIZE",
     "host-memory tier below the device tier; 0 = none; auto = 1/8 of the machine's memory "
     "(its cgroup limit when lower), 1/4 up to 64GiB with a GPU (pinned memory)"},
    {"append-memory-bytes", T_SIZE_AUTO, F(append_memory_bytes), "auto", 0, 1ull << 50, "SIZE",
     "host memory the calls in flight may hold together (append buffers, AppendPages' pages, "
     "uploaded artifacts, calibration samples); a call past it fails with RESOURCE_EXHAUSTED "
     "(0 = unlimited; auto = 1/8 of the memory kvdepotd may use)"},
    {"disk-bytes", T_SIZE, F(disk_bytes), "0", 0, 1ull << 60, "SIZE",
     "page bytes RocksDB may hold (0 = unlimited); beyond it an Append fails with "
     "RESOURCE_EXHAUSTED, or under durability none LRU sequences are dropped"},
    {"prefetch-pages", T_UINT, F(prefetch_pages), "4", 0, 1024, "N",
     "pages a Read loads ahead of the one it serves (0 = no read-ahead)"},
};
#define NSETTINGS (sizeof settings / sizeof settings[0])

_Static_assert(NSETTINGS <= sizeof(((kvd_config *)0)->source), "grow kvd_config.source");

size_t kvd_config_count(void) { return NSETTINGS; }

const char *kvd_config_name(size_t i) { return i < NSETTINGS ? settings[i].name : NULL; }

static int fail(char *err, size_t errlen, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static int fail(char *err, size_t errlen, const char *fmt, ...)
{
    if (err && errlen) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, errlen, fmt, ap);
        va_end(ap);
    }
    return -1;
}

static const setting *find(const char *name, size_t len)
{
    for (size_t i = 0; i < NSETTINGS; i++)
        if (strlen(settings[i].name) == len && strncmp(settings[i].name, name, len) == 0)
            return &settings[i];
    return NULL;
}

/* Unsigned decimal with an optional size suffix; rejects signs, blanks,
 * overflow and trailing garbage. */
static int parse_u64(const char *s, int allow_suffix, uint64_t *out)
{
    if (!isdigit((unsigned char)s[0]))
        return -1;
    errno = 0;
    char *end;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno == ERANGE)
        return -1;
    if (*end && allow_suffix) {
        static const char units[] = "KMGT";
        const char *u = strchr(units, toupper((unsigned char)*end));
        if (u) {
            unsigned shift = 10u * (unsigned)(u - units + 1);
            end++;
            if (*end == 'i' || *end == 'I')
                end++;
            if (v > (UINT64_MAX >> shift))
                return -1;
            v <<= shift;
        }
        if (*end == 'B' || *end == 'b')
            end++;
    }
    if (*end)
        return -1;
    *out = v;
    return 0;
}

int kvd_config_parse_size(const char *s, uint64_t *out) { return parse_u64(s, 1, out); }

static int parse_bool(const char *s, int *out)
{
    static const char *const yes[] = {"1", "true", "yes", "on"};
    static const char *const no[] = {"0", "false", "no", "off"};
    for (int i = 0; i < 4; i++) {
        if (strcasecmp(s, yes[i]) == 0)
            return *out = 1, 0;
        if (strcasecmp(s, no[i]) == 0)
            return *out = 0, 0;
    }
    return -1;
}

int kvd_config_parse_device(const char *s, int *cuda, int *index)
{
    *index = -1;
    if (strcmp(s, "cpu") == 0)
        *cuda = -1;
    else if (strcmp(s, "auto") == 0)
        *cuda = 0;
    else if (strcmp(s, "cuda") == 0)
        *cuda = 1;
    else if (strncmp(s, "cuda:", 5) == 0 && isdigit((unsigned char)s[5]) && strlen(s) <= 8) {
        char *end;
        long n = strtol(s + 5, &end, 10);
        if (*end)
            return -1;
        *cuda = 1;
        *index = (int)n;
    } else
        return -1;
    return 0;
}

int kvd_config_parse_background(const char *s, int *nice)
{
    if (strcmp(s, "off") == 0)
        return *nice = -1, 0;
    if (strcmp(s, "idle") == 0)
        return *nice = 20, 0;
    char *end = NULL;
    long n = strtol(s, &end, 10);
    if (!isdigit((unsigned char)s[0]) || *end || n < 1 || n > 19)
        return -1;
    *nice = (int)n;
    return 0;
}

int kvd_config_parse_durability(const char *s, int *mode)
{
    static const char *const modes[] = {"none", "spill", "sync"};
    for (int i = 0; i < 3; i++)
        if (strcmp(s, modes[i]) == 0)
            return *mode = i, 0;
    return -1;
}

static const char *check_background(const char *v)
{
    int n;
    return kvd_config_parse_background(v, &n) == 0 ? NULL : "idle, off or a nice value 1..19";
}

static const char *check_log_format(const char *v)
{
    return strcmp(v, "logfmt") == 0 || strcmp(v, "json") == 0 ? NULL : "logfmt or json";
}

static const char *check_durability(const char *v)
{
    int m;
    return kvd_config_parse_durability(v, &m) == 0 ? NULL : "none, spill or sync";
}

static const char *check_wal_recovery(const char *v)
{
    return strcmp(v, "strict") == 0 || strcmp(v, "point-in-time") == 0 ? NULL
                                                                       : "strict or point-in-time";
}

static const char *check_device(const char *v)
{
    int cuda, index;
    return kvd_config_parse_device(v, &cuda, &index) == 0 ? NULL : "auto, cpu, cuda or cuda:N";
}

/* The string settings that take one of a few forms: each one's check,
 * NULL when the value is one of them, else what the setting takes. */
static const struct {
    const char *name;
    const char *(*check)(const char *value);
} checks[] = {
    {"background-priority", check_background},
    {"log-format", check_log_format},
    {"durability", check_durability},
    {"wal-recovery", check_wal_recovery},
    {"device", check_device},
};

static const char *check_value(const setting *st, const char *value)
{
    for (size_t i = 0; i < sizeof checks / sizeof checks[0]; i++)
        if (strcmp(checks[i].name, st->name) == 0)
            return checks[i].check(value);
    return NULL;
}

static int set_one(kvd_config *c, const setting *st, const char *value, char *err, size_t errlen)
{
    char *base = (char *)c + st->offset;
    switch (st->type) {
    case T_STRING:
    case T_OPTSTRING: {
        if (st->type == T_STRING && value[0] == '\0')
            return fail(err, errlen, "--%s: must not be empty", st->name);
        const char *why = check_value(st, value);
        if (why)
            return fail(err, errlen, "--%s: '%s' is not %s", st->name, value, why);
        char *dup = NULL;
        if (value[0] && !(dup = strdup(value)))
            return fail(err, errlen, "--%s: out of memory", st->name);
        char **field = (char **)(void *)base;
        free(*field);
        *field = dup;
        return 0;
    }
    case T_UINT:
    case T_SIZE:
    case T_SIZE_AUTO: {
        uint64_t v;
        if (st->type == T_SIZE_AUTO && strcmp(value, "auto") == 0) {
            *(uint64_t *)(void *)base = KVD_CONFIG_AUTO;
            return 0;
        }
        if (parse_u64(value, st->type != T_UINT, &v) != 0)
            return fail(err, errlen, "--%s: '%s' is not %s", st->name, value,
                        st->type == T_SIZE_AUTO ? "a size (e.g. 8MiB, 4096, 2G) or auto"
                        : st->type == T_SIZE    ? "a size (e.g. 8MiB, 4096, 2G)"
                                                : "a non-negative integer");
        if (v < st->min || v > st->max)
            return fail(err, errlen, "--%s: %llu is out of range [%llu, %llu]", st->name,
                        (unsigned long long)v, (unsigned long long)st->min,
                        (unsigned long long)st->max);
        *(uint64_t *)(void *)base = v;
        return 0;
    }
    case T_BOOL: {
        int v;
        if (parse_bool(value, &v) != 0)
            return fail(err, errlen, "--%s: '%s' is not a boolean (true/false)", st->name,
                        value);
        *(int *)(void *)base = v;
        return 0;
    }
    case T_LOGLEVEL: {
        int v = kvd_log_level_parse(value);
        if (v < 0)
            return fail(err, errlen, "--%s: '%s' is not one of debug, info, warn, error",
                        st->name, value);
        *(int *)(void *)base = v;
        return 0;
    }
    }
    return fail(err, errlen, "--%s: unknown setting type", st->name);
}

static int set_from(kvd_config *c, const setting *st, const char *value, int src, char *err,
                    size_t errlen)
{
    if (set_one(c, st, value, err, errlen) != 0)
        return -1;
    c->source[st - settings] = (unsigned char)src;
    return 0;
}

int kvd_config_set(kvd_config *c, const char *name, const char *value, char *err,
                   size_t errlen)
{
    const setting *st = find(name, strlen(name));
    if (!st)
        return fail(err, errlen, "unknown setting '%s' (see --help)", name);
    return set_from(c, st, value, KVD_SRC_FLAG, err, errlen);
}

int kvd_config_defaults(kvd_config *c)
{
    memset(c, 0, sizeof *c);
    for (size_t i = 0; i < NSETTINGS; i++)
        if (set_one(c, &settings[i], settings[i].def, NULL, 0) != 0) {
            kvd_config_free(c);
            return -1;
        }
    return 0;
}

void kvd_config_free(kvd_config *c)
{
    if (!c)
        return;
    for (size_t i = 0; i < NSETTINGS; i++) {
        if (settings[i].type == T_STRING || settings[i].type == T_OPTSTRING) {
            char **field = (char **)(void *)((char *)c + settings[i].offset);
            free(*field);
            *field = NULL;
        }
    }
}

int kvd_config_apply_env(kvd_config *c, char *(*getenv_fn)(const char *), char *err,
                         size_t errlen)
{
    for (size_t i = 0; i < NSETTINGS; i++) {
        char var[64] = "KVDEPOT_";
        size_t o = strlen(var);
        for (const char *p = settings[i].name; *p && o + 1 < sizeof var; p++)
            var[o++] = *p == '-' ? '_' : (char)toupper((unsigned char)*p);
        var[o] = '\0';
        const char *v = getenv_fn(var);
        if (!v)
            continue;
        char inner[256];
        if (set_from(c, &settings[i], v, KVD_SRC_ENV, inner, sizeof inner) != 0)
            return fail(err, errlen, "%s: %s", var, inner);
    }
    return 0;
}

int kvd_config_parse_args(kvd_config *c, int argc, char **argv, int *action, char *err,
                          size_t errlen)
{
    *action = KVD_CONFIG_RUN;
    for (int i = 1; i < argc; i++) {
        const char *arg = argv[i];
        if (strcmp(arg, "--help") == 0 || strcmp(arg, "-h") == 0) {
            *action = KVD_CONFIG_HELP;
            return 0;
        }
        if (strcmp(arg, "--version") == 0 || strcmp(arg, "-V") == 0) {
            *action = KVD_CONFIG_VERSION;
            return 0;
        }
        if (strcmp(arg, "--print-config") == 0) {
            /* Later flags still apply: they are part of what is printed. */
            *action = KVD_CONFIG_PRINT;
            continue;
        }
        if (strncmp(arg, "--", 2) != 0 || arg[2] == '\0')
            return fail(err, errlen, "unexpected argument '%s' (see --help)", arg);
        const char *name = arg + 2;
        const char *eq = strchr(name, '=');
        size_t nlen = eq ? (size_t)(eq - name) : strlen(name);
        const setting *st = find(name, nlen);
        if (!st && !eq && strncmp(name, "no-", 3) == 0) {
            /* --no-sync for booleans */
            const setting *neg = find(name + 3, nlen - 3);
            if (neg && neg->type == T_BOOL) {
                *(int *)(void *)((char *)c + neg->offset) = 0;
                c->source[neg - settings] = KVD_SRC_FLAG;
                continue;
            }
        }
        if (!st)
            return fail(err, errlen, "unknown option '--%.*s' (see --help)", (int)nlen, name);
        const char *value;
        if (eq) {
            value = eq + 1;
        } else if (st->type == T_BOOL) {
            value = "true";
        } else {
            if (i + 1 >= argc)
                return fail(err, errlen, "--%s needs a value (%s)", st->name, st->metavar);
            value = argv[++i];
        }
        if (set_from(c, st, value, KVD_SRC_FLAG, err, errlen) != 0)
            return -1;
    }
    return 0;
}

void kvd_config_usage(FILE *f, const char *prog)
{
    fprintf(f,
            "usage: %s [OPTION]...\n"
            "       %s repair [OPTION]...          repair the store in --data-dir\n"
            "       %s restore BACKUP [OPTION]...  copy a backup into a new --data-dir\n"
            "\n"
            "kvdepot server: stores LLM key/value caches and serves them over gRPC\n"
            "(kvdepot.v1.KVDepot and grpc.health.v1.Health).\n"
            "\n"
            "Options (also read from --config FILE and from the environment as\n"
            "KVDEPOT_<NAME>, e.g. KVDEPOT_DATA_DIR; flags > env > file > defaults).\n"
            "SIZE takes K, M, G, T suffixes (powers of 1024, e.g. 8MiB); BOOL is\n"
            "true/false (a bare flag means true, --no-NAME false).\n"
            "\n",
            prog, prog, prog);
    for (size_t i = 0; i < NSETTINGS; i++) {
        const setting *st = &settings[i];
        char head[96];
        snprintf(head, sizeof head, "--%s %s", st->name, st->metavar);
        fprintf(f, "  %-28s %s\n", head, st->help);
        fprintf(f, "  %-28s (default: %s", "", st->def[0] ? st->def : "none");
        if (st->type != T_STRING && st->type != T_OPTSTRING && st->type != T_BOOL &&
            st->type != T_LOGLEVEL)
            fprintf(f, "; range %llu..%llu", (unsigned long long)st->min,
                    (unsigned long long)st->max);
        fprintf(f, ")\n");
    }
    fprintf(f, "  %-28s %s\n", "--print-config",
            "print the effective settings (and where each came from) as YAML and exit");
    fprintf(f, "  %-28s %s\n", "--help", "print this help and exit");
    fprintf(f, "  %-28s %s\n", "--version", "print the version and exit");
    fprintf(f, "\nExit status: 0 after a clean shutdown (SIGTERM/SIGINT), 1 when the\n"
               "server cannot start, 2 for bad options.\n");
}

/* ---- sizes chosen at start ---------------------------------------------------- */

void kvd_config_tiers(const kvd_config *c, uint64_t machine_bytes, uint64_t gpu_free_bytes,
                      uint64_t *device_tier, uint64_t *host_tier)
{
    uint64_t dev = machine_bytes / 8, host = machine_bytes / 8;
    if (gpu_free_bytes) {
        const uint64_t keep = gpu_free_bytes / 8 > GiB ? gpu_free_bytes / 8 : GiB;
        dev = gpu_free_bytes > keep ? gpu_free_bytes - keep : 0;
        host = machine_bytes / 4 < 64 * GiB ? machine_bytes / 4 : 64 * GiB;
    }
    *device_tier = c->device_tier_bytes == KVD_CONFIG_AUTO ? dev / MiB * MiB : c->device_tier_bytes;
    *host_tier = c->host_tier_bytes == KVD_CONFIG_AUTO ? host / MiB * MiB : c->host_tier_bytes;
}

uint64_t kvd_config_append_memory(const kvd_config *c, uint64_t machine_bytes)
{
    return c->append_memory_bytes == KVD_CONFIG_AUTO ? machine_bytes / 8 / MiB * MiB
                                                     : c->append_memory_bytes;
}

/* The number in file `path` (0 when absent or not a number, as "max" is). */
static uint64_t read_limit(const char *root, const char *path)
{
    char full[512];
    snprintf(full, sizeof full, "%s/%s", root, path);
    FILE *f = fopen(full, "r");
    if (!f)
        return 0;
    char buf[64] = "";
    const int ok = fgets(buf, sizeof buf, f) != NULL;
    fclose(f);
    uint64_t v = 0;
    buf[strcspn(buf, "\n")] = '\0';
    return ok && parse_u64(buf, 0, &v) == 0 ? v : 0;
}

uint64_t kvd_machine_memory(const char *cgroup_root)
{
    const long pages = sysconf(_SC_PHYS_PAGES), size = sysconf(_SC_PAGESIZE);
    uint64_t mem = pages > 0 && size > 0 ? (uint64_t)pages * (uint64_t)size : 0;
    const char *files[] = {"memory.max", "memory/memory.limit_in_bytes"};
    for (size_t i = 0; i < sizeof files / sizeof files[0]; i++) {
        const uint64_t lim = read_limit(cgroup_root, files[i]);
        if (lim && (lim < mem || !mem))
            mem = lim;
    }
    return mem;
}

unsigned kvd_machine_cpus(const char *cgroup_root)
{
    cpu_set_t set;
    CPU_ZERO(&set);
    long n = sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : 0;
    if (n <= 0)
        n = sysconf(_SC_NPROCESSORS_ONLN);
    if (n <= 0)
        n = 1;
    /* a CPU quota: v2 "QUOTA PERIOD" (or "max PERIOD"), v1 two files */
    uint64_t quota = 0, period = 0;
    char full[512], buf[64] = "";
    snprintf(full, sizeof full, "%s/cpu.max", cgroup_root);
    FILE *f = fopen(full, "r");
    if (f) {
        unsigned long long q, p;
        if (fgets(buf, sizeof buf, f) && sscanf(buf, "%llu %llu", &q, &p) == 2) {
            quota = q;
            period = p;
        }
        fclose(f);
    } else {
        quota = read_limit(cgroup_root, "cpu/cpu.cfs_quota_us"); /* -1: none, read as 0 */
        period = read_limit(cgroup_root, "cpu/cpu.cfs_period_us");
    }
    if (quota && period) {
        const uint64_t q = (quota + period - 1) / period; /* whole CPUs, rounded up */
        if (q < (uint64_t)n)
            n = (long)q;
    }
    return (unsigned)n;
}

/* ---- config file ---------------------------------------------------------- */

/* Map a file key to a setting: the option name, with `_` accepted for `-`
 * (YAML users write both). */
static const setting *find_key(const char *key)
{
    char name[64];
    size_t n = strlen(key);
    if (n >= sizeof name)
        return NULL;
    for (size_t i = 0; i <= n; i++)
        name[i] = key[i] == '_' ? '-' : key[i];
    return find(name, n);
}

int kvd_config_apply_file(kvd_config *c, const char *path, char *err, size_t errlen)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return fail(err, errlen, "config file %s: %s", path, strerror(errno));
    yaml_parser_t p;
    if (!yaml_parser_initialize(&p)) {
        fclose(f);
        return fail(err, errlen, "config file %s: out of memory", path);
    }
    yaml_parser_set_input_file(&p, f);
    /* A small state machine over the event stream: the document must be one
     * mapping of scalar keys to scalar values. An empty file is no settings. */
    enum { WANT_KEY, WANT_VALUE } want = WANT_KEY;
    int depth = 0, rc = 0, done = 0;
    const setting *cur = NULL;
    char key[128] = "";
    while (!done && rc == 0) {
        yaml_event_t ev;
        if (!yaml_parser_parse(&p, &ev)) {
            rc = fail(err, errlen, "config file %s:%lu: %s", path,
                      (unsigned long)p.problem_mark.line + 1,
                      p.problem ? p.problem : "YAML syntax error");
            break;
        }
        unsigned long line = (unsigned long)ev.start_mark.line + 1;
        switch (ev.type) {
        case YAML_STREAM_END_EVENT:
            done = 1;
            break;
        case YAML_STREAM_START_EVENT:
        case YAML_DOCUMENT_START_EVENT:
        case YAML_DOCUMENT_END_EVENT:
            break;
        case YAML_MAPPING_START_EVENT:
            if (depth++ != 0)
                rc = fail(err, errlen, "config file %s:%lu: %s: must be a single value, not a "
                          "mapping", path, line, key);
            break;
        case YAML_MAPPING_END_EVENT:
            depth--;
            break;
        case YAML_SEQUENCE_START_EVENT:
            rc = fail(err, errlen, "config file %s:%lu: %s: must be a single value, not a list",
                      path, line, depth ? key : "document");
            break;
        case YAML_ALIAS_EVENT:
            rc = fail(err, errlen, "config file %s:%lu: aliases are not supported", path, line);
            break;
        case YAML_SCALAR_EVENT: {
            const char *v = (const char *)ev.data.scalar.value;
            if (depth != 1) {
                rc = fail(err, errlen, "config file %s:%lu: expected a mapping of settings",
                          path, line);
            } else if (want == WANT_KEY) {
                snprintf(key, sizeof key, "%s", v);
                cur = find_key(v);
                if (!cur || cur->offset == offsetof(kvd_config, config))
                    rc = fail(err, errlen, "config file %s:%lu: unknown setting '%s' (see "
                              "kvdepotd --help)", path, line, key);
                want = WANT_VALUE;
            } else {
                /* A plain `~`/`null`/empty value means "unset" for optional
                 * strings; elsewhere it is a bad value like any other. */
                int is_null = ev.data.scalar.plain_implicit &&
                              (!v[0] || strcmp(v, "~") == 0 || strcasecmp(v, "null") == 0);
                char inner[256];
                if (set_from(c, cur, is_null ? "" : v, KVD_SRC_FILE, inner, sizeof inner) != 0)
                    rc = fail(err, errlen, "config file %s:%lu: %s", path, line, inner);
                want = WANT_KEY;
            }
            break;
        }
        case YAML_SEQUENCE_END_EVENT: /* unreachable: a list start already failed */
        case YAML_NO_EVENT:
            done = 1;
            break;
        }
        yaml_event_delete(&ev);
    }
    yaml_parser_delete(&p);
    fclose(f);
    return rc;
}

int kvd_config_load(kvd_config *c, int argc, char **argv, char *(*getenv_fn)(const char *),
                    int *action, char *err, size_t errlen)
{
    /* The file is applied first, so find its name before anything else:
     * the last --config on the command line, else KVDEPOT_CONFIG. */
    const char *path = getenv_fn("KVDEPOT_CONFIG");
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--config") == 0 && i + 1 < argc)
            path = argv[++i];
        else if (strncmp(argv[i], "--config=", 9) == 0)
            path = argv[i] + 9;
    }
    if (path && path[0] && kvd_config_apply_file(c, path, err, errlen) != 0)
        return -1;
    if (kvd_config_apply_env(c, getenv_fn, err, errlen) != 0)
        return -1;
    return kvd_config_parse_args(c, argc, argv, action, err, errlen);
}

static void print_quoted(FILE *f, const char *s)
{
    fputc('"', f);
    for (; *s; s++) {
        unsigned char ch = (unsigned char)*s;
        if (ch == '"' || ch == '\\')
            fprintf(f, "\\%c", ch);
        else if (ch < 0x20 || ch == 0x7f)
            fprintf(f, "\\x%02x", ch);
        else
            fputc(ch, f);
    }
    fputc('"', f);
}

void kvd_config_print(FILE *f, const kvd_config *c)
{
    static const char *const src[] = {"default", "file", "env", "flag"};
    fprintf(f, "# kvdepotd effective settings (flags > env > file > defaults)\n");
    for (size_t i = 0; i < NSETTINGS; i++) {
        const setting *st = &settings[i];
        const char *base = (const char *)c + st->offset;
        if (st->offset == offsetof(kvd_config, config))
            fprintf(f, "# ");
        fprintf(f, "%s: ", st->name);
        switch (st->type) {
        case T_STRING:
        case T_OPTSTRING: {
            const char *v = *(char *const *)(const void *)base;
            print_quoted(f, v ? v : "");
            break;
        }
        case T_UINT:
        case T_SIZE:
        case T_SIZE_AUTO: {
            const uint64_t v = *(const uint64_t *)(const void *)base;
            if (st->type == T_SIZE_AUTO && v == KVD_CONFIG_AUTO)
                fprintf(f, "auto");
            else
                fprintf(f, "%llu", (unsigned long long)v);
            break;
        }
        case T_BOOL:
            fprintf(f, "%s", *(const int *)(const void *)base ? "true" : "false");
            break;
        case T_LOGLEVEL:
            fprintf(f, "%s", kvd_log_level_name(*(const int *)(const void *)base));
            break;
        }
        unsigned s = c->source[i];
        fprintf(f, "  # %s\n", s < 4 ? src[s] : "?");
    }
}
