/*
 * End-to-end test harness: runs a real kvdepotd on a free port with a
 * temporary data directory, restarts it on the same directory, and offers a
 * few checking macros and reference-data helpers for tests that drive it
 * through libkvdepot.
 */
#ifndef KVDEPOT_E2E_HARNESS_H
#define KVDEPOT_E2E_HARNESS_H

#include "kvdepot.h"

#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/types.h>

/* ------------------------------------------------------------------------ */
/* The server                                                                */
/* ------------------------------------------------------------------------ */

typedef struct kvd_harness {
    const char *server_bin;
    char root[PATH_MAX - 64]; /* temporary directory, removed at the end */
    char data_dir[PATH_MAX];  /* root/data, kept across restarts */
    char port_file[PATH_MAX];
    char log_path[PATH_MAX];  /* the server's stdout+stderr, all runs */
    pid_t pid;                /* 0 when not running */
    int port;
    char addr[64];            /* "127.0.0.1:PORT" */
    int starts;
} kvd_harness;

/* Create the temporary directory. Returns 0 or -1 (message printed). */
int harness_init(kvd_harness *h, const char *server_bin);

/*
 * Start kvdepotd with --listen 127.0.0.1:PORT (0 the first time: a free
 * port; the same port on later starts) --data-dir --port-file, and wait up
 * to 60 s for the port file. Returns 0 or -1 (the server log is printed).
 */
int harness_start(kvd_harness *h);

/* SIGTERM, wait up to 60 s (then SIGKILL). Returns the exit status, or -1
 * when the server did not exit by itself or died of a signal. */
int harness_stop(kvd_harness *h);

/* 1 while the server runs; 0 once it has exited (reported on stderr with
 * its status, once). */
int harness_alive(kvd_harness *h);

/* SIGKILL and reap; for crash tests. */
void harness_kill(kvd_harness *h);

/* harness_stop, then harness_start on the same data directory. Returns 0
 * when the server exited 0 and came back; -1 otherwise. */
int harness_restart(kvd_harness *h);

/* Stop a running server, print its log when KVD_E2E_VERBOSE is set or
 * `failed`, and remove the temporary directory unless KVD_E2E_KEEP is set. */
void harness_destroy(kvd_harness *h, int failed);

/* Print the last `lines` lines of the server log to stderr. */
void harness_dump_log(const kvd_harness *h, int lines);

/* Connect a client to the harness's server with test-friendly options
 * (long deadline, wait_for_ready so restarts are ridden out). */
kvdepot_client *harness_client(const kvd_harness *h);
kvdepot_client *harness_client_opts(const kvd_harness *h, kvdepot_options *opt);

/*
 * Several servers: harness_init + harness_start on each of hs[0..n), each
 * with its own port and data directory. Returns 0, or -1 after destroying
 * the ones it started.
 */
int harness_start_many(kvd_harness *hs, size_t n, const char *server_bin);

/* "ADDR0,ADDR1,..." of the running servers among *hs[0..n), for a sharded
 * client. Returns buf. */
char *harness_addr_list(kvd_harness *const *hs, size_t n, char *buf, size_t cap);

/* ------------------------------------------------------------------------ */
/* Checks                                                                    */
/* ------------------------------------------------------------------------ */

extern int kvd_test_failures;

#define CHECK(cond)                                                              \
    do {                                                                         \
        if (!(cond)) {                                                           \
            fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
            kvd_test_failures++;                                                 \
        }                                                                        \
    } while (0)

/* Check a call's return code; on mismatch print both names and the message. */
#define CHECK_RC(expr, want)                                                     \
    do {                                                                         \
        int rc__ = (expr);                                                       \
        if (rc__ != (want)) {                                                    \
            fprintf(stderr, "%s:%d: %s\n    returned %s (%s), want %s\n", __FILE__, \
                    __LINE__, #expr, kvdepot_status_name(rc__), kvdepot_errmsg(NULL), \
                    kvdepot_status_name(want));                                  \
            kvd_test_failures++;                                                 \
        }                                                                        \
    } while (0)

/* Like CHECK_RC, but gives up on the test (return 1) on mismatch. */
#define REQUIRE_RC(expr, want)                                                   \
    do {                                                                         \
        int rc__ = (expr);                                                       \
        if (rc__ != (want)) {                                                    \
            fprintf(stderr, "%s:%d: %s\n    returned %s (%s), want %s; giving up\n", \
                    __FILE__, __LINE__, #expr, kvdepot_status_name(rc__),        \
                    kvdepot_errmsg(NULL), kvdepot_status_name(want));            \
            kvd_test_failures++;                                                 \
            return 1;                                                            \
        }                                                                        \
    } while (0)

#define REQUIRE(cond)                                                            \
    do {                                                                         \
        if (!(cond)) {                                                           \
            fprintf(stderr, "%s:%d: REQUIRE failed: %s; giving up\n", __FILE__,  \
                    __LINE__, #cond);                                            \
            kvd_test_failures++;                                                 \
            return 1;                                                            \
        }                                                                        \
    } while (0)

/* ------------------------------------------------------------------------ */
/* Test data                                                                 */
/* ------------------------------------------------------------------------ */

/* Fill n bytes with a cheap deterministic pseudo-random stream. */
void fill_random(void *buf, size_t n, uint64_t seed);

/*
 * Reference copy of what a sequence should hold: K and V of every layer up
 * to cap_tokens, laid out [layer][token][kv_head][head_dim], and the token
 * count of each layer. Tests append through ref_append, which also updates
 * the reference when the server accepts, and compare with ref_verify.
 */
typedef struct ref_seq {
    char id[KVDEPOT_ID_MAX + 1];
    kvdepot_model model;
    uint64_t cap_tokens;
    size_t token_bytes;      /* bytes of one token of one layer: kv_heads * head_dim * dtype */
    uint8_t *k, *v;          /* [layers][cap_tokens][...] */
    uint64_t *layer_tokens;  /* [layers] */
} ref_seq;

int ref_init(ref_seq *r, const char *id, const kvdepot_model *m, uint64_t cap_tokens);
void ref_free(ref_seq *r);

/*
 * Build K and V for layers [l0, l0+nl) × the next nt tokens of each layer
 * (all layers must be at the same count) in the wire layout, from seed.
 * Returns malloc'ed K and V buffers of *bytes each (free()).
 */
int ref_make(const ref_seq *r, uint32_t l0, uint32_t nl, uint64_t nt, uint64_t seed,
             uint8_t **k, uint8_t **v, size_t *bytes);

/* Record an accepted append of k/v (as made by ref_make) into the reference. */
void ref_commit(ref_seq *r, uint32_t l0, uint32_t nl, uint64_t nt, const uint8_t *k,
                const uint8_t *v);

/*
 * Append nt fresh tokens to layers [l0, l0+nl) through libkvdepot (chunked
 * by the client's chunk size), with optional token ids. On success the
 * reference is updated. Returns the library's return code.
 */
int ref_append(kvdepot_client *c, ref_seq *r, uint32_t l0, uint32_t nl, uint64_t nt,
               uint64_t seed, const uint32_t *token_ids);
/* ref_append naming the blocks it completes with engine block hashes. */
int ref_append_engine(kvdepot_client *c, ref_seq *r, uint32_t l0, uint32_t nl, uint64_t nt,
                      uint64_t seed, const kvdepot_engine_hashes *eh);

/*
 * Read layers [l0, l0+nl) × tokens [t0, t0+nt) and compare with the
 * reference bit for bit. Returns 0 when equal; prints the first difference.
 */
int ref_check_range(kvdepot_client *c, const ref_seq *r, uint32_t l0, uint32_t nl, uint64_t t0,
                    uint64_t nt);

/*
 * The whole sequence as the reference has it: StatSequence shows the same
 * per-layer token counts and num_tokens, every layer reads back bit-exact
 * over its stored tokens, and a default read (num_tokens = 0) returns all
 * layers × num_tokens. Returns 0 when all hold.
 */
int ref_verify(kvdepot_client *c, const ref_seq *r);

/* ------------------------------------------------------------------------ */
/* Running tests                                                             */
/* ------------------------------------------------------------------------ */

typedef struct kvd_test {
    const char *name;
    /* Returns nonzero to abort; failures are also counted by the macros. */
    int (*fn)(kvd_harness *h);
} kvd_test;

/*
 * main() of a test program: `prog SERVER_BIN [TEST...]` runs the named tests
 * (all when none are named), each against a fresh server and data
 * directory. Prints PASS/FAIL per test; returns the process exit status.
 */
int harness_main(int argc, char **argv, const kvd_test *tests, size_t ntests);

#endif /* KVDEPOT_E2E_HARNESS_H */
