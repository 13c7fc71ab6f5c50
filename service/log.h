/*
 * kvdepotd logging: one logfmt line per event on stderr,
 *
 *     ts=2026-01-02T03:04:05.678Z level=warn req=42 method=Append \
 *         status=INVALID_ARGUMENT msg="data: 12 bytes past the end"
 *
 * KVD_LOG checks the level before any argument is formatted, so debug lines
 * cost one load and a compare when disabled. Lines are written with a single
 * write(2), so lines from concurrent threads never interleave.
 */
#ifndef KVDEPOT_SERVICE_LOG_H
#define KVDEPOT_SERVICE_LOG_H

#include <stdarg.h>
#include <stddef.h>

enum kvd_log_level {
    KVD_LOG_DEBUG = 0,
    KVD_LOG_INFO = 1,
    KVD_LOG_WARN = 2,
    KVD_LOG_ERROR = 3,
};

/* The current threshold; set once at startup, before worker threads exist. */
extern int kvd_log_threshold;
/* 1: each line as one JSON object of string members instead of logfmt
 * ({"ts":"...","level":"warn",...,"msg":"..."}); set once at startup. */
extern int kvd_log_json;

/* "debug", "info", "warn", "error" -> level, or -1. */
int kvd_log_level_parse(const char *s);
const char *kvd_log_level_name(int level);

/* Write one line. `msg` (may be NULL) is quoted and escaped as needed; `kv`
 * is a printf format for further space-separated key=value fields (may be
 * NULL). Prefer KVD_LOG, which skips all of this below the threshold. */
void kvd_log_write(int level, const char *msg, const char *kv, ...)
    __attribute__((format(printf, 3, 4)));

#define KVD_LOG(level, msg, ...)                        \
    do {                                                \
        if ((level) >= kvd_log_threshold)               \
            kvd_log_write((level), (msg), __VA_ARGS__); \
    } while (0)

/* Append `s` to buf as a logfmt value (quoted when it holds spaces, quotes,
 * '=' or control bytes; non-printable bytes as \xNN). Returns the length
 * written, truncating at cap - 1; buf is always NUL-terminated. */
size_t kvd_log_quote(char *buf, size_t cap, const char *s, size_t len);

#endif /* KVDEPOT_SERVICE_LOG_H */
