/* The connection cap: accept4 and close in front of the C library's
 * (conncap.h). */
#include "conncap.h"

#include "log.h"
#include "metrics.h"

#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

/* One bit per descriptor number: set while it is a connection the cap
 * counts. Allocated once by kvd_conncap_start and never freed (the
 * wrappers below may run until the process ends). */
static _Atomic(uint64_t) *open_bits;
static uint64_t nbits;
static uint64_t cap;
static int exempt = -1;
static _Atomic uint64_t nopen, nrefused;
static _Atomic int64_t last_warn_s = -3600; /* the first refusal is logged */

uint64_t kvd_conncap_reserve(uint64_t nofile)
{
    uint64_t r = nofile / 4;
    return r < 64 ? 64 : r;
}

uint64_t kvd_conncap_default(uint64_t nofile)
{
    uint64_t r = kvd_conncap_reserve(nofile);
    return nofile > r + 16 ? nofile - r : 16;
}

int kvd_conncap_start(uint64_t max, uint64_t nofile, int exempt_fd)
{
    uint64_t words = (nofile + 63) / 64;
    _Atomic(uint64_t) *bits = calloc(words ? words : 1, sizeof *bits);
    if (!bits)
        return -1;
    cap = max;
    exempt = exempt_fd;
    nbits = words * 64;
    atomic_store(&open_bits, bits);
    return 0;
}

uint64_t kvd_conncap_open(void)
{
    return atomic_load(&nopen);
}

uint64_t kvd_conncap_refused(void)
{
    return atomic_load(&nrefused);
}

/* A refused connection is reset (linger 0), not closed in order: the client
 * learns at once, and the socket leaves no TIME_WAIT behind. */
static void refuse(int fd)
{
    struct linger l = {.l_onoff = 1, .l_linger = 0};
    setsockopt(fd, SOL_SOCKET, SO_LINGER, &l, sizeof l);
    syscall(SYS_close, fd);
    uint64_t n = atomic_fetch_add(&nrefused, 1) + 1;
    KVD_METRIC_ADD(connections_refused_total, 1);
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    int64_t last = atomic_load(&last_warn_s);
    if (now.tv_sec - last >= 10 && atomic_compare_exchange_strong(&last_warn_s, &last, now.tv_sec))
        KVD_LOG(KVD_LOG_WARN, "connection refused: max-connections reached",
                "max_connections=%llu refused_total=%llu", (unsigned long long)cap,
                (unsigned long long)n);
}

int accept4(int lfd, struct sockaddr *addr, socklen_t *addrlen, int flags)
{
    for (;;) {
        int fd = (int)syscall(SYS_accept4, lfd, addr, addrlen, flags);
        _Atomic(uint64_t) *bits = atomic_load(&open_bits);
        if (fd < 0 || !bits || lfd == exempt || (uint64_t)fd >= nbits)
            return fd;
        if (cap && atomic_fetch_add(&nopen, 1) >= cap) {
            atomic_fetch_sub(&nopen, 1);
            refuse(fd);
            /* A non-blocking listener is drained of what else waits (the
             * gRPC core's listener is edge-triggered); a blocking one
             * answers as if the connection had been aborted. */
            int fl = fcntl(lfd, F_GETFL);
            if (fl >= 0 && (fl & O_NONBLOCK))
                continue;
            errno = ECONNABORTED;
            return -1;
        }
        if (!cap)
            atomic_fetch_add(&nopen, 1);
        atomic_fetch_or(&bits[fd / 64], 1ull << (fd % 64));
        KVD_METRIC_ADD(connections, 1);
        return fd;
    }
}

/* The bit is cleared before the descriptor is: its number cannot be handed
 * out again by an accept in between. */
int close(int fd)
{
    _Atomic(uint64_t) *bits = atomic_load(&open_bits);
    if (bits && fd >= 0 && (uint64_t)fd < nbits) {
        uint64_t m = 1ull << (fd % 64);
        if (atomic_fetch_and(&bits[fd / 64], ~m) & m) {
            atomic_fetch_sub(&nopen, 1);
            KVD_METRIC_ADD(connections, -1);
        }
    }
    return (int)syscall(SYS_close, fd);
}
