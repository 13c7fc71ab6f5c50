/*
 * A cap on the client connections kvdepotd holds open.
 *
 * The gRPC core kvdepotd links (Debian's 1.51) accepts every connection
 * it is offered, until accept4 fails for want of a descriptor; RocksDB then
 * has none left either. kvdepotd's executable defines accept4 and close
 * itself (service/conncap.c), in front of the C library's, so it sees every
 * connection the gRPC core accepts and every descriptor it closes: past the
 * cap, a new connection is reset as soon as it is accepted (the client gets
 * UNAVAILABLE at once) and its descriptor given back, keeping the rest of
 * the descriptor limit for RocksDB's files, the metrics endpoint and the
 * threads.
 *
 * Only kvdepotd links this file, so only its process is affected; a test
 * that links it gets the same cap in its own process.
 */
#ifndef KVDEPOT_SERVICE_CONNCAP_H
#define KVDEPOT_SERVICE_CONNCAP_H

#include <stdint.h>

/* What kvdepotd keeps for itself out of a descriptor limit of `nofile`
 * (RocksDB's files, logs, threads, the metrics endpoint): a quarter of it,
 * at least 64. The default cap is the rest, at least 16 connections. */
uint64_t kvd_conncap_reserve(uint64_t nofile);
uint64_t kvd_conncap_default(uint64_t nofile);

/* Cap connections accepted on every listening socket but `exempt_fd` (the
 * metrics endpoint's, or -1) at `max` (0: no cap, connections are only
 * counted). Call once, before the listener starts accepting; `nofile` is
 * the descriptor limit (it sizes the table of open connections). Returns
 * 0, or -1 when out of memory (nothing is counted then). */
int kvd_conncap_start(uint64_t max, uint64_t nofile, int exempt_fd);

/* Connections open now, and refused since the start. */
uint64_t kvd_conncap_open(void);
uint64_t kvd_conncap_refused(void);

#endif /* KVDEPOT_SERVICE_CONNCAP_H */
