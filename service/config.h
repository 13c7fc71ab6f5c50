/*
 * kvdepotd settings.
 *
 * Every setting lives in one table (config.c): name, type, field, default,
 * bounds and help. The same table drives the command line, the environment
 * (KVDEPOT_<NAME>, dashes as underscores) and --help, so a config file can be
 * layered on later by feeding its name = value pairs to kvd_config_set().
 * Precedence, lowest first: built-in defaults, environment, flags.
 */
#ifndef KVDEPOT_SERVICE_CONFIG_H
#define KVDEPOT_SERVICE_CONFIG_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "log.h"

typedef struct kvd_config {
    char *listen;               /* host:port; port 0 picks a free one */
    char *data_dir;
    uint64_t threads;           /* 0 until resolved = number of CPUs */
    uint64_t compute_threads;   /* CPU threads one compute op may use; 0 = number of CPUs */
    char *background_priority;  /* long requests' compute threads: idle, 1..19 (nice) or off */
    uint64_t page_tokens;
    int sync;                   /* fsync the WAL before acknowledging an append */
    uint64_t max_message_bytes; /* max receive and send message length */
    uint64_t max_append_bytes;  /* K+V bytes of one Append */
    int log_level;              /* a kvd_log_level */
    char *log_format;           /* "logfmt" or "json" */
    char *port_file;            /* NULL = none */
    uint64_t shutdown_grace_ms; /* in-flight calls get this long at shutdown */

    char *config;               /* the config file read, NULL = none */
    /* Transport security. Without a certificate kvdepotd serves plaintext,
     * which is allowed on loopback addresses only unless both `insecure` and
     * `allow_insecure_remote` are set. */
    char *tls_cert, *tls_key;   /* PEM files; both or neither */
    char *tls_client_ca;        /* PEM CA bundle: when set, clients must present
                                   a certificate it signed (mTLS) */
    int insecure;               /* plaintext chosen explicitly */
    int allow_insecure_remote;  /* ... and allowed off loopback */
    char *tokens_file;          /* YAML tokens file; NULL = no authentication */

    /* Limits. 0 means unlimited where noted in the table. */
    uint64_t max_tokens_per_sequence;
    uint64_t tenant_max_sequences;
    uint64_t tenant_max_bytes;
    uint64_t max_concurrent_streams;
    uint64_t keepalive_time_ms;
    uint64_t keepalive_timeout_ms;
    uint64_t handshake_timeout_ms;
    uint64_t max_connections; /* 0 = sized from the descriptor limit at start */
    uint64_t keepalive_min_ping_interval_ms;
    int keepalive_permit_without_calls;

    char *metrics_listen;       /* host:port of the HTTP endpoint; NULL = off */
    int metrics_optional;       /* go on without it when it cannot be bound */

    /* Tiers and durability (store.h). */
    char *durability;           /* "none", "spill" or "sync"; --sync means sync */
    char *wal_recovery;         /* "strict" or "point-in-time" */
    char *device;               /* "auto", "cpu", "cuda" or "cuda:N" */
    uint64_t device_tier_bytes; /* device pool, allocated once; KVD_CONFIG_AUTO: sized at start */
    uint64_t host_tier_bytes;   /* KVD_CONFIG_AUTO: sized at start */
    uint64_t disk_bytes;        /* 0 = unlimited */
    uint64_t append_memory_bytes; /* buffers of appends in flight; 0 = unlimited; KVD_CONFIG_AUTO */
    uint64_t prefetch_pages;

    /* Where each setting's value came from (a kvd_config_source), by table
     * index. */
    unsigned char source[64];
} kvd_config;

/* A size setting left to kvdepotd to choose at start ("auto"). */
#define KVD_CONFIG_AUTO UINT64_MAX

/*
 * The memory tiers' sizes for "auto" (kvd_config_tiers): with a GPU
 * (gpu_free_bytes > 0), the device tier is the GPU's free memory less
 * max(1 GiB, 1/8 of it), and the host tier (pinned memory) 1/4 of the
 * machine's memory, at most 64 GiB; on the CPU each tier is 1/8 of the
 * machine's memory. Sizes set in the configuration are kept. Both are
 * rounded down to MiB.
 */
void kvd_config_tiers(const kvd_config *c, uint64_t machine_bytes, uint64_t gpu_free_bytes,
                      uint64_t *device_tier, uint64_t *host_tier);

/* What the buffers of appends in flight may hold together: as set, or
 * ("auto") 1/8 of machine_bytes, rounded down to MiB. */
uint64_t kvd_config_append_memory(const kvd_config *c, uint64_t machine_bytes);

/* The machine's memory as this process may use it: physical memory, or
 * the cgroup's limit (v2 memory.max, v1 memory.limit_in_bytes under
 * cgroup_root, normally /sys/fs/cgroup) when lower. */
uint64_t kvd_machine_memory(const char *cgroup_root);
/* CPUs this process may use: those it may run on (its affinity), or its
 * cgroup's CPU quota rounded up when lower (v2 cpu.max, v1
 * cpu/cpu.cfs_quota_us over cpu/cpu.cfs_period_us under cgroup_root). */
unsigned kvd_machine_cpus(const char *cgroup_root);

/* Where a setting's effective value came from. */
enum kvd_config_source {
    KVD_SRC_DEFAULT = 0,
    KVD_SRC_FILE = 1,
    KVD_SRC_ENV = 2,
    KVD_SRC_FLAG = 3,
};

/* What the command line asked for besides settings. */
enum kvd_config_action {
    KVD_CONFIG_RUN = 0,
    KVD_CONFIG_HELP = 1,
    KVD_CONFIG_VERSION = 2,
    KVD_CONFIG_PRINT = 3, /* --print-config */
};

/* Fill c with the built-in defaults. Strings are malloc'd; release with
 * kvd_config_free(). Returns 0, or -1 when out of memory. */
int kvd_config_defaults(kvd_config *c);

/* Free the strings held by c (not c itself); c may be reused after
 * kvd_config_defaults(). */
void kvd_config_free(kvd_config *c);

/* Set one setting by its name ("max-message-bytes") from its text form,
 * checking type and bounds. Returns 0, or -1 with a message in err naming the
 * setting and the accepted values. */
int kvd_config_set(kvd_config *c, const char *name, const char *value, char *err,
                   size_t errlen);

/* Apply KVDEPOT_<NAME> environment variables for every setting that has one.
 * `getenv_fn` is getenv in production (tests pass their own). Returns 0 or -1
 * with a message in err. */
int kvd_config_apply_env(kvd_config *c, char *(*getenv_fn)(const char *), char *err,
                         size_t errlen);

/* Parse command-line flags (`--name value`, `--name=value`, bare `--flag` for
 * booleans, `--help`, `--version`). Returns 0 and sets *action, or -1 with a
 * message in err for an unknown flag, a missing or bad value, or a stray
 * argument. */
int kvd_config_parse_args(kvd_config *c, int argc, char **argv, int *action, char *err,
                          size_t errlen);

/* Apply a YAML config file: a mapping of setting names (as in --help, with
 * `-` or `_`) to scalar values. Unknown keys, non-scalar values and bad
 * values fail with a message naming the file, line and key. Returns 0 or -1
 * with a message in err. */
int kvd_config_apply_file(kvd_config *c, const char *path, char *err, size_t errlen);

/* The whole layering used by kvdepotd: defaults, then the config file named
 * by --config (or KVDEPOT_CONFIG), then the environment, then the flags.
 * c must be fresh from kvd_config_defaults(). Returns 0 and sets *action, or
 * -1 with a message in err (exit status 2). */
int kvd_config_load(kvd_config *c, int argc, char **argv, char *(*getenv_fn)(const char *),
                    int *action, char *err, size_t errlen);

/* Print every effective value as YAML that kvd_config_apply_file() accepts,
 * each line with a comment naming its source (default, file, env, flag). */
void kvd_config_print(FILE *f, const kvd_config *c);

/* Parse a size as the table does ("64GiB", "4096"); 0 or -1. */
int kvd_config_parse_size(const char *s, uint64_t *out);

/* The string settings that take one of a few forms (checked as they are
 * set, so that every source, --print-config included, rejects the same
 * values), parsed: 0, or -1 for a value they do not take. */
/* --device: *cuda -1 (cpu), 0 (auto: the first device if any), 1 (cuda:
 * the first device, or *index, required); *index -1 but for cuda:N. */
int kvd_config_parse_device(const char *s, int *cuda, int *index);
/* --background-priority: *nice -1 (off), 1..19, or 20 (idle: SCHED_IDLE,
 * KVD_CPU_BACKGROUND_IDLE). */
int kvd_config_parse_background(const char *s, int *nice);
/* --durability: *mode 0 none, 1 spill, 2 sync. */
int kvd_config_parse_durability(const char *s, int *mode);

/* Print the usage text, one paragraph per setting, to f. */
void kvd_config_usage(FILE *f, const char *prog);

/* Number of settings in the table and the name of the i-th (for tests). */
size_t kvd_config_count(void);
const char *kvd_config_name(size_t i);

#endif /* KVDEPOT_SERVICE_CONFIG_H */
