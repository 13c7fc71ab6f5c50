/*
 * kvdepotd authentication, authorisation and per-tenant quotas.
 *
 * A tokens file (YAML) binds each bearer token to a tenant, the model
 * namespaces it may use (shell globs on model names, `*` = all) and its
 * access (read-only or read-write), with an optional expiry:
 *
 *     tokens:
 *       - token: "3a9f..."            # sent as `authorization: Bearer 3a9f...`
 *         tenant: team-a
 *         namespaces: ["team-a-*"]
 *         access: read-write          # or read-only
 *         expires: 2027-01-01T00:00:00Z   # optional, UTC
 *     tenants:                        # optional per-tenant quota overrides
 *       team-a: {max-sequences: 1000, max-bytes: 64GiB}
 *
 * Without a tokens file every call is accepted as the tenant `anonymous`
 * with access to every model; quotas still apply to it.
 *
 * Quotas count what a tenant holds: the sequences of the models inside its
 * namespaces (the union over its tokens) and their K+V payload bytes. Usage
 * is computed from the store when the table is loaded and kept up to date by
 * the handlers; a sequence whose model lies in the namespaces of two tenants
 * counts against both.
 *
 * A table is immutable once loaded, except for the usage counters (guarded
 * by its mutex), and reference-counted: every call holds the table it was
 * authenticated against, so a reload (SIGHUP) never pulls a principal from
 * under a running call.
 */
#ifndef KVDEPOT_SERVICE_AUTH_H
#define KVDEPOT_SERVICE_AUTH_H

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include <grpc/grpc.h>

#include "kvdepot/status.h"
#include "store.h"

typedef struct kvd_tenant {
    char *name;
    char **namespaces; /* union over the tenant's tokens */
    size_t n_namespaces;
    uint64_t max_sequences, max_bytes; /* 0 = unlimited */
    uint64_t sequences, bytes;         /* usage; guarded by kvd_auth.mu */
    /* the part of the usage reserved by calls not yet committed or failed:
     * a rescan of the store keeps it */
    uint64_t inflight_sequences, inflight_bytes;
} kvd_tenant;

typedef struct kvd_principal {
    char *token;   /* never logged */
    size_t tenant; /* index into kvd_auth.tenants */
    char **namespaces;
    size_t n_namespaces;
    int read_only;
    int admin;       /* access: admin: read-write, and Stats tells of the whole server */
    int64_t expires; /* unix seconds; 0 = never */
} kvd_principal;

typedef struct kvd_auth {
    atomic_int refs;
    int required; /* a tokens file was given: calls must carry a token */
    kvd_principal *tokens;
    size_t n_tokens;
    kvd_tenant *tenants;
    size_t n_tenants;
    pthread_mutex_t mu;
    /* Held across a store change that moves usage (an append or create
     * committing, a delete) and across a rescan, so a rescan sees each
     * change either in the store or in flight, never both or neither. */
    pthread_mutex_t commit_mu;
} kvd_auth;

/* Load the tokens file `path` (NULL = no authentication, one anonymous
 * tenant). Default quotas come from the arguments; the file's `tenants:`
 * section overrides them per tenant. Returns 0 with *out holding one
 * reference, or -1 with a message naming the file, line and problem. */
int kvd_auth_load(const char *path, uint64_t max_sequences, uint64_t max_bytes, kvd_auth **out,
                  char *err, size_t errlen);

/* What the whole store holds, for the metrics gauges. */
typedef struct kvd_store_totals {
    uint64_t sequences, payload_bytes, stored_bytes, sealed_pages;
} kvd_store_totals;

/* Compute every tenant's usage from the store (plus what calls in flight
 * have reserved), and the store's totals (tot may be NULL). Returns 0 or a
 * kvd_status. */
int kvd_auth_scan(kvd_auth *a, kvd_store *store, kvd_store_totals *tot, kvd_error *err);

void kvd_auth_ref(kvd_auth *a);
void kvd_auth_unref(kvd_auth *a); /* NULL is a no-op */

/* Authenticate a call from its metadata. Returns 0 with *out set (NULL when
 * authentication is off), or KVD_EAUTH with a message that never contains
 * the token. */
int kvd_auth_check(const kvd_auth *a, const grpc_metadata_array *md, int64_t now_unix,
                   const kvd_principal **out, kvd_error *err);

/* Tenant name of a principal ("anonymous" for NULL). */
const char *kvd_auth_tenant(const kvd_auth *a, const kvd_principal *p);
/* What the principal's tenant holds (its quota usage): sequences, bytes. */
void kvd_auth_usage(kvd_auth *a, const kvd_principal *p, uint64_t *sequences, uint64_t *bytes);

/* Every tenant's usage and quotas (0 = unlimited), read under the lock:
 * *out malloc'd (names point into a: valid while the caller holds its
 * reference); the count, 0 when out of memory. */
typedef struct kvd_tenant_usage {
    const char *name;
    uint64_t sequences, bytes, max_sequences, max_bytes;
} kvd_tenant_usage;
size_t kvd_auth_tenant_usage(kvd_auth *a, kvd_tenant_usage **out);

/* 1 when p (NULL = unrestricted) may use the model. */
int kvd_auth_model_allowed(const kvd_principal *p, const char *model);

/*
 * Quotas. Reserve one sequence, or `bytes` payload bytes, of model `model`
 * against every tenant whose namespaces hold it: it fails with KVD_ENOMEM
 * naming the quota and the tenant when one would go over (nothing is
 * reserved then), else the amount counts as usage in flight. The call then
 * either commits its store change and settles the reservation, both inside
 * kvd_quota_lock/unlock (the amount stays as usage), or fails and releases
 * it (any time). Forget gives back the usage of something deleted, inside
 * kvd_quota_lock/unlock with the deletion. All take NULL for "no quotas".
 */
int kvd_quota_reserve(kvd_auth *a, const char *model, uint64_t sequences, uint64_t bytes,
                      kvd_error *err);
void kvd_quota_settle(kvd_auth *a, const char *model, uint64_t sequences, uint64_t bytes);
void kvd_quota_release(kvd_auth *a, const char *model, uint64_t sequences, uint64_t bytes);
void kvd_quota_forget(kvd_auth *a, const char *model, uint64_t sequences, uint64_t bytes);
void kvd_quota_lock(kvd_auth *a);
void kvd_quota_unlock(kvd_auth *a);

/* K+V payload bytes a sequence holds: what its appends carried. */
uint64_t kvd_seq_payload_bytes(const kvd_seq_info *s, const kvd_model_info *m);

#endif /* KVDEPOT_SERVICE_AUTH_H */
