/*
 * The connection cap (service/conncap.c), in this process: the test links
 * the same accept4 and close kvdepotd does.
 *
 *  - the default cap leaves a quarter of the descriptor limit (at least 64)
 *    to kvdepotd, and is at least 16;
 *  - on a non-blocking listener, connections past the cap are reset as they
 *    are accepted, and one accept4 call drains the backlog: the client of a
 *    refused connection reads ECONNRESET, the others nothing;
 *  - closing an accepted connection makes room for the next one; closing
 *    anything else leaves the count alone;
 *  - the exempt listener (the metrics endpoint) is neither capped nor
 *    counted;
 *  - a blocking listener answers a refused connection with ECONNABORTED.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "conncap.h"
#include "metrics.h"

static int failures;
#define CHECK(cond)                                                                                \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond);               \
            failures++;                                                                            \
        }                                                                                          \
    } while (0)

static int listener(int nonblock, struct sockaddr_in *at)
{
    int fd = socket(AF_INET, SOCK_STREAM | (nonblock ? SOCK_NONBLOCK : 0), 0);
    memset(at, 0, sizeof *at);
    at->sin_family = AF_INET;
    at->sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof *at;
    if (fd < 0 || bind(fd, (struct sockaddr *)at, sizeof *at) != 0 || listen(fd, 64) != 0 ||
        getsockname(fd, (struct sockaddr *)at, &len) != 0) {
        perror("listener");
        return -1;
    }
    return fd;
}

/* A connected client (the kernel completes the handshake from the backlog). */
static int dial(const struct sockaddr_in *at)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0 || connect(fd, (const struct sockaddr *)at, sizeof *at) != 0) {
        perror("connect");
        return -1;
    }
    return fd;
}

/* What the client's end reads: 0 when nothing is there (still open),
 * otherwise the errno of a reset or -1 for an orderly close. */
static int client_state(int fd)
{
    char b;
    ssize_t n = recv(fd, &b, 1, MSG_DONTWAIT);
    if (n < 0)
        return errno == EAGAIN || errno == EWOULDBLOCK ? 0 : errno;
    return n == 0 ? -1 : 0;
}

/* Accept until the listener is empty; the descriptors accepted go to out. */
static int drain(int lfd, int *out, int max)
{
    int n = 0;
    for (;;) {
        int fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
        if (fd < 0) {
            CHECK(errno == EAGAIN || errno == EWOULDBLOCK);
            return n;
        }
        if (n < max)
            out[n++] = fd;
        else
            close(fd);
    }
}

int main(void)
{
    CHECK(kvd_conncap_reserve(1024) == 256);
    CHECK(kvd_conncap_default(1024) == 768);
    CHECK(kvd_conncap_reserve(100) == 64);
    CHECK(kvd_conncap_default(100) == 36);
    CHECK(kvd_conncap_default(64) == 16);
    CHECK(kvd_conncap_default(1 << 20) == 786432);

    struct sockaddr_in a, ax, ab;
    int l = listener(1, &a), lx = listener(1, &ax), lb = listener(0, &ab);
    if (l < 0 || lx < 0 || lb < 0)
        return 1;
    /* Before the start nothing is counted. */
    int pre_c = dial(&a);
    int pre[1];
    CHECK(drain(l, pre, 1) == 1);
    CHECK(kvd_conncap_open() == 0);
    close(pre[0]);
    close(pre_c);

    CHECK(kvd_conncap_start(3, 4096, lx) == 0);
    int c[6], s[6];
    for (int i = 0; i < 5; i++)
        c[i] = dial(&a);
    usleep(20000);
    CHECK(drain(l, s, 6) == 3);
    CHECK(kvd_conncap_open() == 3);
    CHECK(kvd_conncap_refused() == 2);
    CHECK(atomic_load(&kvd_metrics.connections) == 3);
    CHECK(atomic_load(&kvd_metrics.connections_refused_total) == 2);
    usleep(20000);
    for (int i = 0; i < 3; i++)
        CHECK(client_state(c[i]) == 0);
    for (int i = 3; i < 5; i++)
        CHECK(client_state(c[i]) == ECONNRESET);

    /* Room again once one closes; other descriptors do not count. */
    close(s[0]);
    CHECK(kvd_conncap_open() == 2);
    close(c[3]);
    close(c[4]);
    int other = open("/dev/null", O_RDONLY);
    close(other);
    CHECK(close(-1) == -1 && errno == EBADF);
    CHECK(kvd_conncap_open() == 2);
    c[5] = dial(&a);
    usleep(20000);
    CHECK(drain(l, &s[0], 1) == 1);
    CHECK(kvd_conncap_open() == 3);
    CHECK(client_state(c[5]) == 0);

    /* The exempt listener takes connections past the cap, uncounted. */
    int x[2], xs[2];
    x[0] = dial(&ax);
    x[1] = dial(&ax);
    usleep(20000);
    CHECK(drain(lx, xs, 2) == 2);
    CHECK(kvd_conncap_open() == 3);
    CHECK(kvd_conncap_refused() == 2);
    for (int i = 0; i < 2; i++) {
        close(xs[i]);
        close(x[i]);
    }
    CHECK(kvd_conncap_open() == 3);

    /* A blocking listener: the refusal is ECONNABORTED, not a wait. */
    int b = dial(&ab);
    usleep(20000);
    errno = 0;
    CHECK(accept4(lb, NULL, NULL, 0) == -1 && errno == ECONNABORTED);
    CHECK(kvd_conncap_refused() == 3);
    close(b);

    for (int i = 0; i < 3; i++)
        close(s[i]);
    CHECK(kvd_conncap_open() == 0);
    CHECK(atomic_load(&kvd_metrics.connections) == 0);
    for (int i = 0; i < 3; i++)
        close(c[i]);
    close(c[5]);
    close(l);
    close(lx);
    close(lb);
    if (failures) {
        fprintf(stderr, "test_conncap: %d check(s) failed\n", failures);
        return 1;
    }
    printf("test_conncap: ok\n");
    return 0;
}
