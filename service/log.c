#include "log.h"

#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

int kvd_log_threshold = KVD_LOG_INFO;
int kvd_log_json = 0;

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

/* The logfmt line in[0..n) as one JSON object into out (NUL-terminated):
 * every key=value pair a string member, values unquoted and unescaped
 * (\xNN as \u00NN). Returns the length. */
static size_t to_json(const char *in, size_t n, char *out, size_t cap)
{
    size_t o = 0, i = 0;
#define PUT(c)                                                                                     \
    do {                                                                                           \
        if (o + 1 < cap)                                                                           \
            out[o++] = (c);                                                                        \
    } while (0)
    PUT('{');
    int first = 1;
    while (i < n) {
        while (i < n && in[i] == ' ')
            i++;
        size_t k0 = i;
        while (i < n && in[i] != '=' && in[i] != ' ')
            i++;
        if (i >= n || in[i] != '=' || i == k0)
            break;
        if (!first)
            PUT(',');
        first = 0;
        PUT('"');
        for (size_t j = k0; j < i; j++)
            PUT(in[j]);
        PUT('"');
        PUT(':');
        PUT('"');
        i++; /* '=' */
        const int quoted = i < n && in[i] == '"';
        if (quoted)
            i++;
        while (i < n && (quoted ? in[i] != '"' : in[i] != ' ')) {
            char c = in[i++];
            if (c == '\\' && i < n) {
                char e = in[i++];
                if (e == 'x' && i + 1 < n) {
                    PUT('\\');
                    PUT('u');
                    PUT('0');
                    PUT('0');
                    PUT(in[i]);
                    PUT(in[i + 1]);
                    i += 2;
                } else if (e == 'n') {
                    PUT('\\');
                    PUT('n');
                } else {
                    PUT('\\');
                    PUT(e);
                }
            } else if ((unsigned char)c < ' ') {
                PUT(' ');
            } else {
                PUT(c);
            }
        }
        if (quoted && i < n)
            i++;
        PUT('"');
    }
    PUT('}');
#undef PUT
    out[o] = '\0';
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
    const char *out = line;
    char json[3072];
    if (kvd_log_json) {
        n = to_json(line, n, json, sizeof json - 1);
        out = json;
    }
    char *end = (char *)out + n;
    *end = '\n';
    /* One write per line; a failed log write has nowhere to be reported. */
    ssize_t w = write(STDERR_FILENO, out, n + 1);
    (void)w;
}
