/*
 * kvdepotd metrics: a process-wide registry rendered as Prometheus text on
 * an HTTP endpoint (libmicrohttpd), beside /healthz and /readyz.
 *
 * Plain counters and gauges are one line each in KVD_METRICS below: the name
 * (without the `kvdepot_` prefix), its type and its help. Add a line and
 * update it with KVD_METRIC_ADD / KVD_METRIC_SET; rendering picks it up.
 *
 * Per-call series are kept apart: request counts and latency histograms by
 * method and status, filled by kvd_metrics_observe() when a call ends.
 */
#ifndef KVDEPOT_SERVICE_METRICS_H
#define KVDEPOT_SERVICE_METRICS_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#define KVD_METRICS(X)                                                                             \
    X(bytes_received_total, counter, "gRPC message bytes received")                                \
    X(bytes_sent_total, counter, "gRPC message bytes sent")                                        \
    X(calls_in_flight, gauge, "calls accepted and not yet ended")                                  \
    X(checksum_failures_total, counter, "reads refused because a page failed its checksum")        \
    X(auth_failures_total, counter, "calls refused as UNAUTHENTICATED")                            \
    X(permission_denied_total, counter, "calls refused as PERMISSION_DENIED")                      \
    X(quota_rejections_total, counter, "calls refused by a tenant quota")                          \
    X(sequences_stored, gauge, "sequences in the store")                                           \
    X(payload_bytes_stored, gauge, "K+V payload bytes the stored sequences hold")                  \
    X(stored_bytes, gauge, "bytes of the stored pages (encoded)")                                  \
    X(pages_sealed, gauge, "sealed pages in the store")                                            \
    X(connections, gauge, "client connections open")                                               \
    X(connections_refused_total, counter, "connections reset on accept: max-connections reached")  \
    X(tokens_reloads_total, counter, "tokens file reloads (SIGHUP) that succeeded")                \
    X(ready, gauge, "1 when serving, 0 while starting or shutting down")

typedef struct kvd_metrics_registry {
#define KVD__METRIC_FIELD(name, type, help) _Atomic int64_t name;
    KVD_METRICS(KVD__METRIC_FIELD)
#undef KVD__METRIC_FIELD
} kvd_metrics_registry;

extern kvd_metrics_registry kvd_metrics;

#define KVD_METRIC_ADD(name, v)                                                                    \
    atomic_fetch_add_explicit(&kvd_metrics.name, (int64_t)(v), memory_order_relaxed)
#define KVD_METRIC_SET(name, v)                                                                    \
    atomic_store_explicit(&kvd_metrics.name, (int64_t)(v), memory_order_relaxed)

/* The store whose tier statistics /metrics renders (kvd_store_stats), or
 * NULL. Set once the store is open, cleared before it closes. */
struct kvd_store;
extern struct kvd_store *_Atomic kvd_metrics_store;
/* The service whose tenants' usage /metrics renders (kvd_service_auth), or
 * NULL; set and cleared as kvd_metrics_store. */
struct kvd_service;
extern struct kvd_service *_Atomic kvd_metrics_service;

/* The process's resident memory in bytes (0 when unknown). */
uint64_t kvd_process_rss(void);

/* Record one ended call: method index into kvd_methods (or -1 for an unknown
 * path), kvd status (0 or negative), duration in seconds. */
void kvd_metrics_observe(int method, int status, double seconds);

/* Render everything in the Prometheus text format (0.0.4) into a malloc'd,
 * NUL-terminated buffer; NULL when out of memory. */
char *kvd_metrics_render(size_t *len);

/* Start the HTTP endpoint on host:port (port 0 = any free port). `ready`
 * points at the service's readiness flag for /readyz. Returns 0 and the
 * bound port; -2 when addr is not an address, -1 when it cannot be bound
 * (in use, not this machine's), with a message in err. */
typedef struct kvd_http kvd_http;
int kvd_http_start(const char *addr, const atomic_int *ready, kvd_http **out, int *port, char *err,
                   size_t errlen);
void kvd_http_stop(kvd_http *h); /* NULL is a no-op */
/* The endpoint's listening socket; -1 for NULL. */
int kvd_http_listen_fd(const kvd_http *h);

#endif /* KVDEPOT_SERVICE_METRICS_H */
