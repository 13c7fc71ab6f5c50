#include "log.h"

#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

int kvd_log_threshold = KVD_LOG_INFO;

static const char *const level_names[] = {"debug", "info", "warn", "error"};

int kvd_log_level_parse(const char *s)
{
    for (int i = 0; i < 4; i++)
        if (strcmp(s, level_names[i]) == 0)
            return i;
    return -1;
}

const char *kvd_log_level_name(int level)
{
    return level >= 0 && level < 4 ? level_names[level] : "unknown";
}

static int needs_quotes(const char *s, size_t len)
{
    if (len == 0)
        return 1;
    for (size_t i = 0; i < len; i++) {
        unsigned char ch = (unsigned char)s[i];
        if (ch <= ' ' || ch == '"' || ch == '=' || ch == '\\' || ch >= 0x7f)
            return 1;
    }
    return 0;
}

size_t kvd_log_quote(char *buf, size_t cap, const char *s, size_t len)
{
    static const char hex[] = "0123456789abcdef";
    size_t o = 0;
    if (cap == 0)
        return 0;
    int q = needs_quotes(s, len);
#define PUT(c)                  \
    do {                        \
        if (o + 1 < cap)        \
            buf[o++] = (c);     \
    } while (0)
    if (q)
        PUT('"');
    for (size_t i = 0; i < len && o + 1 < cap; i++) {
        unsigned char ch = (unsigned char)s[i];
        if (ch == '"' || ch == '\\') {
            PUT('\\');
            PUT((char)ch);
        } else if (ch == '\n') {
            PUT('\\');
            PUT('n');
        } else if (ch < ' ' || ch >= 0x7f) {
            /* Keep lines one per event and ASCII, whatever ids contain. */
            PUT('\\');
            PUT('x');
            PUT(hex[ch >> 4]);
            PUT(hex[ch & 15]);
        } else {
            PUT((char)ch);
        }
    }
    if (q)
        PUT('"');
#undef PUT
    buf[o] = '\0';
    return o;
}

void kvd_log_write(int level, const char *msg, const char *kv, ...)
{
    char line[2048];
    size_t n = 0;
    struct timespec ts;
    struct tm tm;
    clock_gettime(CLOCK_REALTIME, &ts);
    gmtime_r(&ts.tv_sec, &tm);
    n += strftime(line, sizeof line, "ts=%Y-%m-%dT%H:%M:%S", &tm);
    n += (size_t)snprintf(line + n, sizeof line - n, ".%03ldZ level=%s",
                          ts.tv_nsec / 1000000, kvd_log_level_name(level));
    if (kv && kv[0]) {
        va_list ap;
        va_start(ap, kv);
        line[n++] = ' ';
        int w = vsnprintf(line + n, sizeof line - n, kv, ap);
        va_end(ap);
        if (w > 0)
            n += (size_t)w < sizeof line - n ? (size_t)w : sizeof line - n - 1;
    }
    if (msg && n + 8 < sizeof line) {
        memcpy(line + n, " msg=", 5);
        n += 5;
        n += kvd_log_quote(line + n, sizeof line - n - 1, msg, strlen(msg));
    }
    if (n > sizeof line - 2)
        n = sizeof line - 2;
    line[n++] = '\n';
    /* One write per line; a failed log write has nowhere to be reported. */
    ssize_t w = write(STDERR_FILENO, line, n);
    (void)w;
}
