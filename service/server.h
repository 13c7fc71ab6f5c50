/*
 * kvdepotd server loop on the gRPC C core completion-queue API.
 */
#ifndef KVDEPOT_SERVICE_SERVER_H
#define KVDEPOT_SERVICE_SERVER_H

#include <stddef.h>

#include "rpc.h"

typedef struct kvd_server kvd_server;

/* Bind cfg->listen, start cfg->threads workers (each with its own completion
 * queue) and begin serving the method table with svc. *port is the bound port
 * (useful when the configured port is 0). Returns 0, or -1 with a message in
 * err; nothing is left running on failure. grpc_init() must have been
 * called. */
int kvd_server_start(kvd_service *svc, kvd_server **out, int *port, char *err, size_t errlen);

/* Check the transport-security settings before anything starts: TLS files
 * given in pairs, plaintext only on loopback unless both --insecure and
 * --allow-insecure-remote are set. Returns 0, or -1 with a message (a
 * configuration error: exit status 2). */
int kvd_server_check_security(const kvd_config *cfg, char *err, size_t errlen);

/* `kvdepotd repair` (repair.c): RocksDB's repair of cfg->data_dir, then
 * every page of every sequence read and verified; prints the sequences
 * that lost pages. Exit status: 0 intact, 3 some sequences lost pages,
 * 1 the repair failed. */
int kvd_repair_run(const kvd_config *cfg, const char *prog);

/* `kvdepotd restore BACKUP` (repair.c): copy the files of a backup (Backup
 * RPC) into cfg->data_dir, which must not exist or be empty, then open the
 * store there to check it. Exit status 0, or 1 with a message. */
int kvd_restore_run(const kvd_config *cfg, const char *backup, const char *prog);

/* 1 when a gRPC listen address can only be reached from this machine
 * (127.0.0.0/8, ::1, localhost, unix sockets). */
int kvd_listen_is_loopback(const char *listen);

/* Stop accepting calls, give in-flight calls grace_ms to finish, cancel the
 * rest, drain and destroy the completion queues, join the workers and free
 * the server. svc->serving must already be 0. The store is not touched:
 * close it afterwards. */
void kvd_server_shutdown(kvd_server *srv, uint64_t grace_ms);

#endif /* KVDEPOT_SERVICE_SERVER_H */
