/*
 * libkvdepot over several servers: a sharded client.
 *
 * kvdepot_connect() builds one when the address names several endpoints
 * ("a:50051,b:50051") or a DNS name standing for all its addresses
 * ("shards:kvdepot-headless:50051"). The sharded client owns one ordinary
 * single-server client per endpoint (a "member") and forwards each public
 * call to the right members:
 *
 *   - sequences go to the owner of their id, prefix lookups to the owner of
 *     the chain's first block hash, both chosen by rendezvous hashing: every
 *     endpoint scores the key with xxh3(endpoint name, key) and the highest
 *     score wins. Adding an endpoint therefore moves only the keys it now
 *     wins (about 1/N of them), all onto itself; removing one moves only its
 *     own keys.
 *   - model writes go to every member; model reads go to any member.
 *   - compute calls on a sequence go to its owner; an Attend batch is split
 *     by owner and the shares run in parallel; Calibrate runs on one member
 *     and its artifacts are copied to the others.
 *
 * There is no protocol between servers: each server is independent and the
 * placement is computed by every client alike, so all clients with the same
 * endpoint list agree on where a key lives.
 *
 * Unreachable servers. A member that cannot be reached within
 * connect_timeout_ms is retried shard_retries times with a doubling pause,
 * then marked down for a doubling time (capped at SHARD_BACKOFF_CAP times
 * shard_backoff_ms); while down, calls on its keys fail at once without
 * contacting it. A success marks it up again. For its keys reads answer
 * KVDEPOT_ENOTFOUND (a cache miss), lookups match 0 blocks, writes answer
 * KVDEPOT_EUNAVAIL, so no call waits longer than its bounded retries.
 *
 * DNS. "shards:HOST:PORT" is resolved with getaddrinfo at connect, every
 * resolve_interval_ms afterwards and soon after a member fails; each address
 * is one endpoint named "IP:PORT". Members that disappear from the answer
 * are closed once no call uses them (reference counts).
 *
 * Locking: one mutex guards the member table and each member's up/down
 * state. Calls take a reference to their member under the mutex and run the
 * RPC without it; name resolution runs without it too.
 */
#include "internal.h"

#include <grpc/support/time.h>

#include <errno.h>
#include <netdb.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <xxhash.h>

#define SHARD_SCHEME "shards:"
/* A down member is skipped for at most this many times shard_backoff_ms. */
#define SHARD_BACKOFF_CAP 32
/* Re-resolution after a failure waits at least this long since the last one,
 * so a dead member does not turn every call into a DNS query. */
#define RESOLVE_MIN_GAP_MS 1000
#define ENDPOINT_MAX 300

typedef struct shard {
    char *name;          /* endpoint: the configured target, or "IP:PORT" */
    uint64_t name_hash;  /* xxh3 of name: the endpoint's rendezvous seed */
    kvdepot_client *client;
    int refs;            /* 1 for the member table + 1 per call using it */
    int dynamic;         /* came from a shards: name */
    unsigned failures;   /* consecutive failed attempts */
    int64_t down_until;  /* monotonic ms; calls fail at once before this */
} shard;

struct kvdepot__cluster {
    pthread_mutex_t mu;
    kvdepot_options opt;     /* members' options; address set per member */
    char **specs;            /* the endpoints as configured */
    size_t nspecs;
    int has_dns;             /* some spec is shards:HOST:PORT */
    shard **shards;
    size_t n;
    int64_t next_resolve;    /* monotonic ms */
    int64_t last_resolve;
    int resolving;
    /* Copies of the options' strings: members are also created after
     * kvdepot_connect returned, when the caller's strings may be gone. */
    char *owned[5];
    /* Why the last member could not be created (kvdepot_connect's answer). */
    int member_rc;
    char member_msg[256];
};

static int64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void sleep_ms(uint32_t ms)
{
    struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (long)(ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
        ;
}

/* ------------------------------------------------------------------------ */
/* Placement                                                                 */
/* ------------------------------------------------------------------------ */

/*
 * The bytes of an id that decide its placement: the text between the first
 * '{' and the next '}' when that is not empty (a hash tag, so that related
 * ids can be kept together), otherwise the whole id.
 */
static void placement_key(const void *id, size_t len, const uint8_t **key, size_t *klen)
{
    const uint8_t *p = id;
    *key = p;
    *klen = len;
    const uint8_t *open = len ? memchr(p, '{', len) : NULL;
    if (!open)
        return;
    size_t rest = len - (size_t)(open - p) - 1;
    const uint8_t *close = rest ? memchr(open + 1, '}', rest) : NULL;
    if (close && close > open + 1) {
        *key = open + 1;
        *klen = (size_t)(close - open - 1);
    }
}

/* Rendezvous score of a key on an endpoint: xxh3 of the key seeded with
 * the endpoint's own hash, so each endpoint ranks keys independently. */
static uint64_t score(const shard *s, const uint8_t *key, size_t klen)
{
    return XXH3_64bits_withSeed(key, klen, s->name_hash);
}

/* Index of the owner of key among shards[0..n); ties (never seen in
 * practice) go to the smaller name so every client agrees. */
static size_t owner_index(shard *const *shards, size_t n, const uint8_t *key, size_t klen)
{
    size_t best = 0;
    uint64_t best_score = 0;
    for (size_t i = 0; i < n; i++) {
        uint64_t sc = score(shards[i], key, klen);
        if (i == 0 || sc > best_score ||
            (sc == best_score && strcmp(shards[i]->name, shards[best]->name) < 0)) {
            best = i;
            best_score = sc;
        }
    }
    return best;
}

/* ------------------------------------------------------------------------ */
/* Members                                                                   */
/* ------------------------------------------------------------------------ */

static shard *shard_new(kvdepot__cluster *cl, const char *name, const char *host)
{
    shard *s = calloc(1, sizeof *s);
    if (!s || !(s->name = strdup(name))) {
        free(s);
        return NULL;
    }
    s->name_hash = XXH3_64bits(name, strlen(name));
    s->refs = 1;
    s->dynamic = host != NULL;
    kvdepot_options o = cl->opt;
    o.address = name;
    if (host && !o.tls_server_name)
        o.tls_server_name = host;
    /* Waiting is bounded by connect_timeout_ms here, never by the server. */
    o.wait_for_ready = 0;
    int rc = kvdepot_connect(&o, &s->client);
    if (rc != KVDEPOT_OK) {
        cl->member_rc = rc;
        snprintf(cl->member_msg, sizeof cl->member_msg, "%s", kvdepot_errmsg(NULL));
        free(s->name);
        free(s);
        return NULL;
    }
    return s;
}

/* Drop one reference; called with cl->mu held. The member is closed when
 * the last call using it has finished. */
static void shard_unref_locked(shard *s)
{
    if (--s->refs > 0)
        return;
    kvdepot_close(s->client);
    free(s->name);
    free(s);
}

/*
 * Wait until the member's channel is connected, at most timeout_ms. A
 * channel in TRANSIENT_FAILURE has just failed to connect and is waiting
 * out gRPC's own reconnect backoff: report it unreachable at once.
 * Returns 1 when connected.
 */
static int wait_connected(shard *s, uint32_t timeout_ms)
{
    grpc_channel *ch = s->client->channel;
    grpc_connectivity_state st = grpc_channel_check_connectivity_state(ch, 1);
    if (st == GRPC_CHANNEL_READY)
        return 1;
    if (st == GRPC_CHANNEL_TRANSIENT_FAILURE || st == GRPC_CHANNEL_SHUTDOWN)
        return 0;
    gpr_timespec deadline = gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC),
                                         gpr_time_from_millis(timeout_ms, GPR_TIMESPAN));
    grpc_completion_queue *cq = grpc_completion_queue_create_for_pluck(NULL);
    int ok = 0;
    for (;;) {
        int tag;
        grpc_channel_watch_connectivity_state(ch, st, deadline, cq, &tag);
        grpc_event ev = grpc_completion_queue_pluck(cq, &tag, gpr_inf_future(GPR_CLOCK_REALTIME),
                                                    NULL);
        /* success 0: the deadline passed without a change. */
        if (ev.type != GRPC_OP_COMPLETE || !ev.success)
            break;
        st = grpc_channel_check_connectivity_state(ch, 0);
        if (st == GRPC_CHANNEL_READY) {
            ok = 1;
            break;
        }
        if (st == GRPC_CHANNEL_TRANSIENT_FAILURE || st == GRPC_CHANNEL_SHUTDOWN)
            break;
    }
    grpc_completion_queue_shutdown(cq);
    while (grpc_completion_queue_pluck(cq, NULL, gpr_inf_future(GPR_CLOCK_REALTIME), NULL).type !=
           GRPC_QUEUE_SHUTDOWN)
        ;
    grpc_completion_queue_destroy(cq);
    return ok;
}

/* ------------------------------------------------------------------------ */
/* Endpoints and name resolution                                             */
/* ------------------------------------------------------------------------ */

/* Split "HOST:PORT" / "[V6]:PORT" into host and port. 0 or -1. */
static int split_host_port(const char *hp, char *host, size_t hcap, char *port, size_t pcap)
{
    const char *colon;
    const char *h = hp;
    size_t hlen;
    if (*hp == '[') {
        const char *end = strchr(hp, ']');
        if (!end || end[1] != ':')
            return -1;
        h = hp + 1;
        hlen = (size_t)(end - h);
        colon = end + 1;
    } else {
        colon = strrchr(hp, ':');
        if (!colon)
            return -1;
        hlen = (size_t)(colon - hp);
    }
    if (hlen == 0 || hlen >= hcap || !colon[1] || strlen(colon + 1) >= pcap)
        return -1;
    memcpy(host, h, hlen);
    host[hlen] = '\0';
    strcpy(port, colon + 1);
    return 0;
}

/* Append (name, host) to the endpoint list; host is NULL for a literal
 * target. 0 or -1. */
typedef struct endpoint_list {
    char **names;
    char **hosts;
    size_t n, cap;
} endpoint_list;

static int push_endpoint(endpoint_list *l, const char *name, const char *host)
{
    for (size_t i = 0; i < l->n; i++)
        if (strcmp(l->names[i], name) == 0)
            return 0;
    if (l->n == l->cap) {
        size_t nc = l->cap ? l->cap * 2 : 8;
        char **nn = realloc(l->names, nc * sizeof *nn);
        if (!nn)
            return -1;
        l->names = nn;
        char **nh = realloc(l->hosts, nc * sizeof *nh);
        if (!nh)
            return -1;
        l->hosts = nh;
        l->cap = nc;
    }
    char *n = strdup(name), *h = host ? strdup(host) : NULL;
    if (!n || (host && !h)) {
        free(n);
        free(h);
        return -1;
    }
    l->names[l->n] = n;
    l->hosts[l->n] = h;
    l->n++;
    return 0;
}

static void free_endpoints(endpoint_list *l)
{
    for (size_t i = 0; i < l->n; i++) {
        free(l->names[i]);
        free(l->hosts[i]);
    }
    free(l->names);
    free(l->hosts);
    memset(l, 0, sizeof *l);
}

/* The endpoints of one spec, appended to l. 0, or -1 when a name could not
 * be resolved. */
static int spec_endpoints(kvdepot_client *c, const char *spec, endpoint_list *l)
{
    if (strncmp(spec, SHARD_SCHEME, strlen(SHARD_SCHEME)) != 0)
        return push_endpoint(l, spec, NULL);
    char host[256], port[32];
    if (split_host_port(spec + strlen(SHARD_SCHEME), host, sizeof host, port, sizeof port) != 0)
        return -1;
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM};
    struct addrinfo *res = NULL;
    int e = getaddrinfo(host, port, &hints, &res);
    if (e != 0) {
        kvdepot__log(c, KVDEPOT_LOG_WARN, "kvdepot: cannot resolve %s: %s", host, gai_strerror(e));
        return -1;
    }
    int rc = 0;
    for (struct addrinfo *ai = res; ai && rc == 0; ai = ai->ai_next) {
        char ip[INET6_ADDRSTRLEN], name[ENDPOINT_MAX];
        if (ai->ai_family == AF_INET) {
            inet_ntop(AF_INET, &((struct sockaddr_in *)ai->ai_addr)->sin_addr, ip, sizeof ip);
            snprintf(name, sizeof name, "%s:%s", ip, port);
        } else if (ai->ai_family == AF_INET6) {
            inet_ntop(AF_INET6, &((struct sockaddr_in6 *)ai->ai_addr)->sin6_addr, ip, sizeof ip);
            snprintf(name, sizeof name, "[%s]:%s", ip, port);
        } else {
            continue;
        }
        /* TLS checks the server's certificate against the name that was
         * resolved, not the pod address it resolved to. */
        rc = push_endpoint(l, name, host);
    }
    freeaddrinfo(res);
    return rc;
}

static void free_names(char **names, size_t n)
{
    for (size_t i = 0; i < n; i++)
        free(names[i]);
    free(names);
}

/*
 * Resolve every spec and make the member table match the answer: members
 * whose endpoint is still named stay (with their connection and state),
 * new endpoints get a member, the others are dropped. A spec that does not
 * resolve keeps its current members, so a DNS hiccup does not move keys.
 * Returns 0, or -1 when nothing could be built.
 */
static int resolve(kvdepot_client *c)
{
    kvdepot__cluster *cl = c->cluster;
    endpoint_list l = {0};
    int failed_dns = 0;
    for (size_t i = 0; i < cl->nspecs; i++)
        if (spec_endpoints(c, cl->specs[i], &l) != 0)
            failed_dns = 1;
    size_t n = l.n;
    char **names = l.names;

    pthread_mutex_lock(&cl->mu);
    shard **next = calloc(n + cl->n + 1, sizeof *next);
    if (!next) {
        pthread_mutex_unlock(&cl->mu);
        free_endpoints(&l);
        return -1;
    }
    size_t m = 0;
    for (size_t i = 0; i < n; i++) {
        shard *s = NULL;
        for (size_t j = 0; j < cl->n && !s; j++)
            if (strcmp(cl->shards[j]->name, names[i]) == 0)
                s = cl->shards[j];
        if (s) {
            s->refs++;
        } else {
            s = shard_new(cl, names[i], l.hosts[i]);
            if (!s) {
                kvdepot__log(c, KVDEPOT_LOG_WARN, "kvdepot: cannot create a client for %s",
                             names[i]);
                continue;
            }
            kvdepot__log(c, KVDEPOT_LOG_INFO, "kvdepot: shard %s added", names[i]);
        }
        next[m++] = s;
    }
    /* Keep resolved members of a name that did not answer this time. */
    if (failed_dns) {
        for (size_t j = 0; j < cl->n; j++) {
            int kept = 0;
            for (size_t i = 0; i < m && !kept; i++)
                kept = next[i] == cl->shards[j];
            if (!kept && cl->shards[j]->dynamic) {
                cl->shards[j]->refs++;
                next[m++] = cl->shards[j];
            }
        }
    }
    for (size_t j = 0; j < cl->n; j++) {
        int kept = 0;
        for (size_t i = 0; i < m && !kept; i++)
            kept = next[i] == cl->shards[j];
        if (!kept)
            kvdepot__log(c, KVDEPOT_LOG_INFO, "kvdepot: shard %s removed", cl->shards[j]->name);
        shard_unref_locked(cl->shards[j]);
    }
    free(cl->shards);
    cl->shards = next;
    cl->n = m;
    int64_t t = now_ms();
    cl->last_resolve = t;
    cl->next_resolve = cl->has_dns && cl->opt.resolve_interval_ms
                           ? t + cl->opt.resolve_interval_ms
                           : INT64_MAX;
    pthread_mutex_unlock(&cl->mu);
    free_endpoints(&l);
    return 0;
}

/* Re-resolve when the timer says so; one thread at a time, the others go
 * on with the current table. */
static void maybe_resolve(kvdepot_client *c)
{
    kvdepot__cluster *cl = c->cluster;
    if (!cl->has_dns)
        return;
    pthread_mutex_lock(&cl->mu);
    int go = !cl->resolving && now_ms() >= cl->next_resolve;
    if (go)
        cl->resolving = 1;
    pthread_mutex_unlock(&cl->mu);
    if (!go)
        return;
    resolve(c);
    pthread_mutex_lock(&cl->mu);
    cl->resolving = 0;
    pthread_mutex_unlock(&cl->mu);
}

/* ------------------------------------------------------------------------ */
/* Connect and close                                                         */
/* ------------------------------------------------------------------------ */

int kvdepot__cluster_wanted(const char *address)
{
    return address && (strchr(address, ',') ||
                       strncmp(address, SHARD_SCHEME, strlen(SHARD_SCHEME)) == 0);
}

static void cluster_free(kvdepot_client *c)
{
    kvdepot__cluster *cl = c->cluster;
    if (cl) {
        for (size_t i = 0; i < cl->n; i++)
            shard_unref_locked(cl->shards[i]);
        free(cl->shards);
        free_names(cl->specs, cl->nspecs);
        for (size_t i = 0; i < sizeof cl->owned / sizeof cl->owned[0]; i++)
            free(cl->owned[i]);
        pthread_mutex_destroy(&cl->mu);
        free(cl);
    }
    free(c->address);
    free(c);
}

int kvdepot__cluster_connect(const kvdepot_options *opt, kvdepot_client **out)
{
    kvdepot_client *c = calloc(1, sizeof *c);
    kvdepot__cluster *cl = calloc(1, sizeof *cl);
    if (!c || !cl || !(c->address = strdup(opt->address))) {
        free(c);
        free(cl);
        return kvdepot__fail(NULL, KVDEPOT_ENOMEM, "kvdepot_connect: out of memory");
    }
    c->cluster = cl;
    c->deadline_ms = opt->deadline_ms;
    c->max_message_bytes = opt->max_message_bytes;
    c->chunk_bytes = opt->chunk_bytes;
    c->log = opt->log;
    c->log_user = opt->log_user;
    c->log_level = opt->log_level;
    pthread_mutex_init(&cl->mu, NULL);
    cl->opt = *opt;
    /* Zero would make every member that is not already connected count as
     * unreachable, and every retry immediate. */
    if (!cl->opt.connect_timeout_ms)
        cl->opt.connect_timeout_ms = 1000;
    if (!cl->opt.shard_backoff_ms)
        cl->opt.shard_backoff_ms = 100;
    const char **strs[] = {&cl->opt.tls_ca_file, &cl->opt.tls_cert_file, &cl->opt.tls_key_file,
                           &cl->opt.tls_server_name, &cl->opt.token};
    _Static_assert(sizeof strs / sizeof strs[0] == sizeof cl->owned / sizeof cl->owned[0],
                   "one copy per string option");
    for (size_t i = 0; i < sizeof strs / sizeof strs[0]; i++) {
        if (!*strs[i])
            continue;
        if (!(cl->owned[i] = strdup(*strs[i]))) {
            cluster_free(c);
            return kvdepot__fail(NULL, KVDEPOT_ENOMEM, "kvdepot_connect: out of memory");
        }
        *strs[i] = cl->owned[i];
    }

    /* Split the list; blanks around commas are allowed. */
    size_t cap = 0;
    const char *p = opt->address;
    int rc = KVDEPOT_OK;
    while (*p && rc == KVDEPOT_OK) {
        while (*p == ',' || *p == ' ' || *p == '\t')
            p++;
        const char *e = p;
        while (*e && *e != ',')
            e++;
        size_t len = (size_t)(e - p);
        while (len && (p[len - 1] == ' ' || p[len - 1] == '\t'))
            len--;
        if (len >= ENDPOINT_MAX) {
            rc = kvdepot__fail(NULL, KVDEPOT_EINVAL, "kvdepot_connect: endpoint \"%.40s...\" too long",
                               p);
        } else if (len) {
            if (cl->nspecs == cap) {
                cap = cap ? cap * 2 : 8;
                char **ns = realloc(cl->specs, cap * sizeof *ns);
                if (!ns) {
                    rc = kvdepot__fail(NULL, KVDEPOT_ENOMEM, "kvdepot_connect: out of memory");
                    break;
                }
                cl->specs = ns;
            }
            char *s = strndup(p, len);
            if (!s) {
                rc = kvdepot__fail(NULL, KVDEPOT_ENOMEM, "kvdepot_connect: out of memory");
                break;
            }
            cl->specs[cl->nspecs++] = s;
            if (strncmp(s, SHARD_SCHEME, strlen(SHARD_SCHEME)) == 0) {
                char host[256], port[32];
                if (split_host_port(s + strlen(SHARD_SCHEME), host, sizeof host, port,
                                    sizeof port) != 0)
                    rc = kvdepot__fail(NULL, KVDEPOT_EINVAL,
                                       "kvdepot_connect: \"%s\" is not shards:HOST:PORT", s);
                cl->has_dns = 1;
            }
        }
        p = e;
    }
    if (rc == KVDEPOT_OK && cl->nspecs == 0)
        rc = kvdepot__fail(NULL, KVDEPOT_EINVAL, "kvdepot_connect: no endpoint in \"%s\"",
                           opt->address);
    if (rc == KVDEPOT_OK && resolve(c) != 0)
        rc = kvdepot__fail(NULL, KVDEPOT_ENOMEM, "kvdepot_connect: out of memory");
    /* Every literal endpoint must get a client: the same options serve all
     * of them, so one failing (a TLS file that cannot be read) fails all. */
    if (rc == KVDEPOT_OK && cl->member_rc)
        rc = kvdepot__fail(NULL, cl->member_rc, "%s", cl->member_msg);
    if (rc != KVDEPOT_OK) {
        cluster_free(c);
        return rc;
    }
    /* No server yet behind a DNS name (pods still starting) is not an
     * error: calls answer UNAVAILABLE and look the name up again. */
    if (cl->n == 0)
        kvdepot__log(c, KVDEPOT_LOG_WARN, "kvdepot: no server found behind %s yet", opt->address);
    kvdepot__log(c, KVDEPOT_LOG_INFO, "kvdepot: sharded client over %zu servers (%s)", cl->n,
                 opt->address);
    *out = c;
    return KVDEPOT_OK;
}

void kvdepot__cluster_close(kvdepot_client *c)
{
    cluster_free(c);
}

/* ------------------------------------------------------------------------ */
/* Running a call on a member                                                */
/* ------------------------------------------------------------------------ */

/* The member owning key, with a reference; NULL when there are none. */
static shard *pick(kvdepot_client *c, const uint8_t *key, size_t klen)
{
    kvdepot__cluster *cl = c->cluster;
    maybe_resolve(c);
    pthread_mutex_lock(&cl->mu);
    shard *s = NULL;
    if (cl->n) {
        s = cl->shards[owner_index(cl->shards, cl->n, key, klen)];
        s->refs++;
    }
    pthread_mutex_unlock(&cl->mu);
    return s;
}

/* A reference to every member, for broadcasts. *out is malloc'ed. */
static size_t pick_all(kvdepot_client *c, shard ***out)
{
    kvdepot__cluster *cl = c->cluster;
    maybe_resolve(c);
    pthread_mutex_lock(&cl->mu);
    size_t n = cl->n;
    *out = calloc(n ? n : 1, sizeof **out);
    if (!*out)
        n = 0;
    for (size_t i = 0; i < n; i++) {
        (*out)[i] = cl->shards[i];
        cl->shards[i]->refs++;
    }
    pthread_mutex_unlock(&cl->mu);
    return n;
}

static void release(kvdepot_client *c, shard *s)
{
    pthread_mutex_lock(&c->cluster->mu);
    shard_unref_locked(s);
    pthread_mutex_unlock(&c->cluster->mu);
}

static void release_all(kvdepot_client *c, shard **v, size_t n)
{
    pthread_mutex_lock(&c->cluster->mu);
    for (size_t i = 0; i < n; i++)
        shard_unref_locked(v[i]);
    pthread_mutex_unlock(&c->cluster->mu);
    free(v);
}

typedef int (*member_op)(kvdepot_client *member, void *ctx);

/*
 * Run op on a member: fail at once while it is marked down; otherwise wait
 * for a connection (bounded), run, and on UNAVAILABLE retry with a doubling
 * pause. After the last attempt the member is marked down. Returns op's
 * code; an unreachable member gives KVDEPOT_EUNAVAIL with a message naming
 * it.
 */
static int run_on(kvdepot_client *c, shard *s, member_op op, void *ctx)
{
    kvdepot__cluster *cl = c->cluster;
    const kvdepot_options *o = &cl->opt;
    uint32_t pause = o->shard_backoff_ms;
    for (uint32_t attempt = 0;; attempt++) {
        pthread_mutex_lock(&cl->mu);
        int64_t until = s->down_until;
        pthread_mutex_unlock(&cl->mu);
        if (now_ms() < until)
            return kvdepot__fail(c, KVDEPOT_EUNAVAIL,
                                 "server %s unreachable (retried in %lld ms)", s->name,
                                 (long long)(until - now_ms()));
        int rc;
        if (!wait_connected(s, o->connect_timeout_ms))
            rc = kvdepot__fail(c, KVDEPOT_EUNAVAIL, "server %s unreachable", s->name);
        else
            rc = op(s->client, ctx);
        if (rc != KVDEPOT_EUNAVAIL) {
            pthread_mutex_lock(&cl->mu);
            s->failures = 0;
            s->down_until = 0;
            pthread_mutex_unlock(&cl->mu);
            return rc;
        }
        if (attempt >= o->shard_retries) {
            pthread_mutex_lock(&cl->mu);
            unsigned f = s->failures < 16 ? s->failures : 16;
            uint64_t down = (uint64_t)o->shard_backoff_ms << f;
            if (down > (uint64_t)o->shard_backoff_ms * SHARD_BACKOFF_CAP)
                down = (uint64_t)o->shard_backoff_ms * SHARD_BACKOFF_CAP;
            s->failures++;
            s->down_until = now_ms() + (int64_t)down;
            /* The server may have moved (a rescheduled pod): look again. */
            if (cl->has_dns && cl->next_resolve > cl->last_resolve + RESOLVE_MIN_GAP_MS)
                cl->next_resolve = cl->last_resolve + RESOLVE_MIN_GAP_MS;
            pthread_mutex_unlock(&cl->mu);
            kvdepot__log(c, KVDEPOT_LOG_WARN, "kvdepot: server %s unreachable, skipped for %llu ms",
                         s->name, (unsigned long long)down);
            return rc;
        }
        sleep_ms(pause);
        pause *= 2;
    }
}

/* Run op on the owner of key. No member at all is UNAVAILABLE. */
static int run_keyed(kvdepot_client *c, const uint8_t *key, size_t klen, member_op op, void *ctx)
{
    shard *s = pick(c, key, klen);
    if (!s)
        return kvdepot__fail(c, KVDEPOT_EUNAVAIL, "no server behind %s", c->address);
    int rc = run_on(c, s, op, ctx);
    release(c, s);
    return rc;
}

static int run_for_id(kvdepot_client *c, const void *id, size_t id_len, member_op op, void *ctx)
{
    const uint8_t *key;
    size_t klen;
    placement_key(id, id_len, &key, &klen);
    return run_keyed(c, key, klen, op, ctx);
}

/* A read that found its server unreachable is a miss: NOT_FOUND. */
static int as_miss(kvdepot_client *c, int rc)
{
    if (rc != KVDEPOT_EUNAVAIL)
        return rc;
    char msg[600];
    snprintf(msg, sizeof msg, "%s", kvdepot_errmsg(c));
    return kvdepot__fail(c, KVDEPOT_ENOTFOUND, "not found: %s", msg);
}

/* ------------------------------------------------------------------------ */
/* Health and models                                                         */
/* ------------------------------------------------------------------------ */

struct health_ctx {
    const char *service;
    kvdepot_serving out;
};

static int op_health(kvdepot_client *m, void *p)
{
    struct health_ctx *x = p;
    return kvdepot_health_check(m, x->service, &x->out);
}

int kvdepot__cluster_health_check(kvdepot_client *c, const char *service, kvdepot_serving *out)
{
    shard **v;
    size_t n = pick_all(c, &v);
    size_t answered = 0, serving = 0;
    int err = KVDEPOT_OK;
    for (size_t i = 0; i < n; i++) {
        struct health_ctx x = {service, KVDEPOT_SERVING_UNKNOWN};
        int rc = run_on(c, v[i], op_health, &x);
        if (rc == KVDEPOT_OK) {
            answered++;
            serving += x.out == KVDEPOT_SERVING;
        } else if (rc != KVDEPOT_EUNAVAIL && !err) {
            err = rc;
        }
    }
    release_all(c, v, n);
    if (err)
        return err;
    if (!answered)
        return kvdepot__fail(c, KVDEPOT_EUNAVAIL, "no server behind %s answered", c->address);
    /* Serving means every server does: a missing one loses its keys. */
    if (out)
        *out = serving == n ? KVDEPOT_SERVING : KVDEPOT_NOT_SERVING;
    kvdepot__clear_error();
    return KVDEPOT_OK;
}

struct model_put_ctx {
    const kvdepot_model *model;
    int replace;
    kvdepot_model out;
    int created;
};

static int op_model_put(kvdepot_client *m, void *p)
{
    struct model_put_ctx *x = p;
    return kvdepot_model_put(m, x->model, x->replace, &x->out, &x->created);
}

/*
 * Model writes go to every server. The first real error (not UNAVAILABLE)
 * is returned; servers that cannot be reached are skipped (they learn the
 * model when a sequence is created on them, see op_create); only when none
 * could be reached is the answer UNAVAILABLE.
 */
int kvdepot__cluster_model_put(kvdepot_client *c, const kvdepot_model *model, int replace,
                               kvdepot_model *out, int *created)
{
    if (out)
        memset(out, 0, sizeof *out);
    if (created)
        *created = 0;
    shard **v;
    size_t n = pick_all(c, &v);
    int err = KVDEPOT_OK, any = 0;
    for (size_t i = 0; i < n; i++) {
        struct model_put_ctx x = {.model = model, .replace = replace};
        int rc = run_on(c, v[i], op_model_put, &x);
        if (rc == KVDEPOT_OK) {
            if (!any && out)
                *out = x.out;
            if (created && x.created)
                *created = 1;
            any = 1;
        } else if (rc != KVDEPOT_EUNAVAIL && !err) {
            err = rc;
        }
    }
    release_all(c, v, n);
    if (err) {
        if (out)
            memset(out, 0, sizeof *out);
        if (created)
            *created = 0;
        return err;
    }
    if (!any)
        return kvdepot__fail(c, KVDEPOT_EUNAVAIL, "model put: no server behind %s answered",
                             c->address);
    kvdepot__clear_error();
    return KVDEPOT_OK;
}

/* Members in rendezvous order of a model name: model reads ask them in
 * turn, so repeated reads of one model use one server. */
static size_t pick_for_model(kvdepot_client *c, const char *name, shard ***out)
{
    shard **v;
    size_t n = pick_all(c, &v);
    size_t klen = name ? strlen(name) : 0;
    for (size_t i = 0; i < n; i++)
        for (size_t j = i + 1; j < n; j++)
            if (score(v[j], (const uint8_t *)name, klen) > score(v[i], (const uint8_t *)name, klen)) {
                shard *t = v[i];
                v[i] = v[j];
                v[j] = t;
            }
    *out = v;
    return n;
}

struct model_get_ctx {
    const char *name;
    kvdepot_model *out;
};

static int op_model_get(kvdepot_client *m, void *p)
{
    struct model_get_ctx *x = p;
    return kvdepot_model_get(m, x->name, x->out);
}

/* From any server: the servers in rendezvous order of the name, first
 * answer wins. NOT_FOUND only when every reachable server says so. */
int kvdepot__cluster_model_get(kvdepot_client *c, const char *name, kvdepot_model *out)
{
    shard **v;
    size_t n = pick_for_model(c, name, &v);
    int rc = KVDEPOT_EUNAVAIL, seen = KVDEPOT_EUNAVAIL;
    for (size_t i = 0; i < n; i++) {
        struct model_get_ctx x = {name, out};
        rc = run_on(c, v[i], op_model_get, &x);
        if (rc == KVDEPOT_OK || (rc != KVDEPOT_ENOTFOUND && rc != KVDEPOT_EUNAVAIL))
            break;
        if (rc == KVDEPOT_ENOTFOUND)
            seen = rc;
    }
    release_all(c, v, n);
    if (rc == KVDEPOT_EUNAVAIL && seen == KVDEPOT_ENOTFOUND)
        return kvdepot__fail(c, KVDEPOT_ENOTFOUND, "no model \"%s\"", name ? name : "");
    if (rc == KVDEPOT_EUNAVAIL && n == 0)
        return kvdepot__fail(c, KVDEPOT_EUNAVAIL, "no server behind %s", c->address);
    return rc;
}

struct model_list_ctx {
    kvdepot_model *list;
    size_t count;
};

static int op_model_list(kvdepot_client *m, void *p)
{
    struct model_list_ctx *x = p;
    return kvdepot_model_list(m, &x->list, &x->count);
}

/* The union over every reachable server, by name, first seen wins. */
int kvdepot__cluster_model_list(kvdepot_client *c, kvdepot_model **out, size_t *count)
{
    if (!out || !count)
        return kvdepot_model_list(NULL, out, count);
    *out = NULL;
    *count = 0;
    shard **v;
    size_t n = pick_all(c, &v);
    kvdepot_model *all = NULL;
    size_t na = 0;
    int rc = KVDEPOT_OK, any = 0;
    for (size_t i = 0; i < n && rc == KVDEPOT_OK; i++) {
        struct model_list_ctx x = {0};
        int r = run_on(c, v[i], op_model_list, &x);
        if (r == KVDEPOT_EUNAVAIL)
            continue;
        if (r != KVDEPOT_OK) {
            rc = r;
            break;
        }
        any = 1;
        for (size_t k = 0; k < x.count; k++) {
            int dup = 0;
            for (size_t j = 0; j < na && !dup; j++)
                dup = strcmp(all[j].name, x.list[k].name) == 0;
            if (dup)
                continue;
            kvdepot_model *na2 = realloc(all, (na + 1) * sizeof *na2);
            if (!na2) {
                rc = kvdepot__fail(c, KVDEPOT_ENOMEM, "model list: out of memory");
                break;
            }
            all = na2;
            all[na++] = x.list[k];
        }
        kvdepot_free(x.list);
    }
    release_all(c, v, n);
    if (rc == KVDEPOT_OK && !any)
        rc = kvdepot__fail(c, KVDEPOT_EUNAVAIL, "model list: no server behind %s answered",
                           c->address);
    if (rc != KVDEPOT_OK) {
        free(all);
        return rc;
    }
    *out = all;
    *count = na;
    kvdepot__clear_error();
    return KVDEPOT_OK;
}

struct model_delete_ctx {
    const char *name;
    int force;
    uint64_t deleted;
};

static int op_model_delete(kvdepot_client *m, void *p)
{
    struct model_delete_ctx *x = p;
    return kvdepot_model_delete(m, x->name, x->force, &x->deleted);
}

/* On every server. A real error wins, then success on any server, then
 * NOT_FOUND, then UNAVAILABLE. Deleted sequences are summed. */
int kvdepot__cluster_model_delete(kvdepot_client *c, const char *name, int force,
                                  uint64_t *deleted)
{
    if (deleted)
        *deleted = 0;
    shard **v;
    size_t n = pick_all(c, &v);
    int err = KVDEPOT_OK, ok = 0, notfound = 0;
    uint64_t sum = 0;
    char msg[600] = "";
    for (size_t i = 0; i < n; i++) {
        struct model_delete_ctx x = {name, force, 0};
        int rc = run_on(c, v[i], op_model_delete, &x);
        if (rc == KVDEPOT_OK) {
            ok = 1;
            sum += x.deleted;
        } else if (rc == KVDEPOT_ENOTFOUND) {
            notfound = 1;
        } else if (rc != KVDEPOT_EUNAVAIL && !err) {
            err = rc;
            snprintf(msg, sizeof msg, "%s", kvdepot_errmsg(c));
        }
    }
    release_all(c, v, n);
    if (deleted)
        *deleted = sum;
    if (err)
        return kvdepot__fail(c, err, "%s", msg);
    if (ok) {
        kvdepot__clear_error();
        return KVDEPOT_OK;
    }
    if (notfound)
        return kvdepot__fail(c, KVDEPOT_ENOTFOUND, "no model \"%s\"", name ? name : "");
    return kvdepot__fail(c, KVDEPOT_EUNAVAIL, "model delete: no server behind %s answered",
                         c->address);
}

/* ------------------------------------------------------------------------ */
/* Sequences                                                                 */
/* ------------------------------------------------------------------------ */

struct create_ctx {
    kvdepot_client *cluster;
    const kvdepot_create_args *args;
    kvdepot_sequence_info *out;
};

/*
 * Create on the owner. A server that joined after the model was put does
 * not know it yet: copy the model from another server and try once more.
 */
/*
 * After a create on server m failed with KVDEPOT_ENOTFOUND: when m lacks
 * the model, copy it from another server (KVDEPOT_OK: try once more); when
 * m knows it, the failure stands (1), m's error message as it was.
 */
static int copy_model(kvdepot_client *cluster, kvdepot_client *m, const char *name)
{
    char was[512];
    snprintf(was, sizeof was, "%s", kvdepot_errmsg(m));
    kvdepot_model model;
    if (kvdepot_model_get(m, name, &model) != KVDEPOT_ENOTFOUND) {
        kvdepot__fail(m, KVDEPOT_ENOTFOUND, "%s", was);
        return 1;
    }
    if (kvdepot__cluster_model_get(cluster, name, &model) != KVDEPOT_OK)
        return kvdepot__fail(m, KVDEPOT_ENOTFOUND, "no model \"%s\"", name);
    int r = kvdepot_model_put(m, &model, 0, NULL, NULL);
    if (r != KVDEPOT_OK && r != KVDEPOT_EEXIST)
        return r;
    kvdepot__log(cluster, KVDEPOT_LOG_INFO, "kvdepot: model %s copied to a server that lacked it",
                 model.name);
    return KVDEPOT_OK;
}

static int op_create(kvdepot_client *m, void *p)
{
    struct create_ctx *x = p;
    int rc = kvdepot_sequence_create(m, x->args, x->out);
    if (rc != KVDEPOT_ENOTFOUND || !x->args || !x->args->model)
        return rc;
    int r = copy_model(x->cluster, m, x->args->model);
    if (r == 1)
        return kvdepot__fail(m, rc, "no such prefix on this server (model \"%s\" is known)",
                             x->args->model);
    return r ? r : kvdepot_sequence_create(m, x->args, x->out);
}

int kvdepot__cluster_sequence_create(kvdepot_client *c, const kvdepot_create_args *a,
                                     kvdepot_sequence_info *out)
{
    if (!a)
        return kvdepot_sequence_create(NULL, a, out);
    struct create_ctx x = {c, a, out};
    return run_for_id(c, a->id, a->id_len, op_create, &x);
}

struct stat_ctx {
    const void *id;
    size_t id_len;
    kvdepot_sequence_info *out;
    uint64_t *freed;
};

static int op_stat(kvdepot_client *m, void *p)
{
    struct stat_ctx *x = p;
    return kvdepot_sequence_stat(m, x->id, x->id_len, x->out);
}

int kvdepot__cluster_sequence_stat(kvdepot_client *c, const void *id, size_t id_len,
                                   kvdepot_sequence_info *out)
{
    struct stat_ctx x = {id, id_len, out, NULL};
    return as_miss(c, run_for_id(c, id, id_len, op_stat, &x));
}

static int op_delete(kvdepot_client *m, void *p)
{
    struct stat_ctx *x = p;
    return kvdepot_sequence_delete(m, x->id, x->id_len, x->freed);
}

int kvdepot__cluster_sequence_delete(kvdepot_client *c, const void *id, size_t id_len,
                                     uint64_t *freed)
{
    struct stat_ctx x = {id, id_len, NULL, freed};
    return run_for_id(c, id, id_len, op_delete, &x);
}

struct evict_ctx {
    const void *id;
    size_t id_len;
    uint64_t *pages, *bytes;
};

static int op_evict(kvdepot_client *m, void *p)
{
    struct evict_ctx *x = p;
    return kvdepot_sequence_evict(m, x->id, x->id_len, x->pages, x->bytes);
}

/* Eviction is a hint: an unreachable owner holds nothing in memory to
 * evict, which is a miss like a read. */
int kvdepot__cluster_sequence_evict(kvdepot_client *c, const void *id, size_t id_len,
                                    uint64_t *pages, uint64_t *bytes)
{
    struct evict_ctx x = {id, id_len, pages, bytes};
    return as_miss(c, run_for_id(c, id, id_len, op_evict, &x));
}

struct seq_list_ctx {
    const char *model;
    kvdepot_sequence_info *list;
    size_t count;
};

static int op_seq_list(kvdepot_client *m, void *p)
{
    struct seq_list_ctx *x = p;
    return kvdepot_sequence_list(m, x->model, &x->list, &x->count);
}

/* Every reachable server's sequences together. A server that does not
 * know the model has none of its sequences; NOT_FOUND only when none
 * knows it. */
int kvdepot__cluster_sequence_list(kvdepot_client *c, const char *model,
                                   kvdepot_sequence_info **out, size_t *count)
{
    if (!out || !count)
        return kvdepot_sequence_list(NULL, model, out, count);
    *out = NULL;
    *count = 0;
    shard **v;
    size_t n = pick_all(c, &v);
    kvdepot_sequence_info *all = NULL;
    size_t na = 0;
    int rc = KVDEPOT_OK, ok = 0, notfound = 0;
    for (size_t i = 0; i < n && rc == KVDEPOT_OK; i++) {
        struct seq_list_ctx x = {model, NULL, 0};
        int r = run_on(c, v[i], op_seq_list, &x);
        if (r == KVDEPOT_EUNAVAIL)
            continue;
        if (r == KVDEPOT_ENOTFOUND) {
            notfound = 1;
            continue;
        }
        if (r != KVDEPOT_OK) {
            rc = r;
            break;
        }
        ok = 1;
        if (x.count) {
            kvdepot_sequence_info *nl = realloc(all, (na + x.count) * sizeof *nl);
            if (!nl) {
                kvdepot_sequence_list_free(x.list, x.count);
                rc = kvdepot__fail(c, KVDEPOT_ENOMEM, "sequence list: out of memory");
                break;
            }
            all = nl;
            /* The infos move over; their arrays now belong to `all`. */
            memcpy(all + na, x.list, x.count * sizeof *all);
            na += x.count;
            free(x.list);
        }
    }
    release_all(c, v, n);
    if (rc == KVDEPOT_OK && !ok)
        rc = notfound ? kvdepot__fail(c, KVDEPOT_ENOTFOUND, "no model \"%s\"", model ? model : "")
                      : kvdepot__fail(c, KVDEPOT_EUNAVAIL,
                                      "sequence list: no server behind %s answered", c->address);
    if (rc != KVDEPOT_OK) {
        kvdepot_sequence_list_free(all, na);
        return rc;
    }
    *out = all;
    *count = na;
    kvdepot__clear_error();
    return KVDEPOT_OK;
}

struct append_ctx {
    const kvdepot_append_args *args;
    kvdepot_sequence_info *out;
    kvdepot_client *cluster; /* its progress callback, its models */
};

/* An append that creates its sequence copies a missing model as op_create
 * does. */
static int op_append(kvdepot_client *m, void *p)
{
    struct append_ctx *x = p;
    const kvdepot_create_args *cr = x->args->create;
    int rc = kvdepot__append(m, x->args, x->out, x->cluster->progress, x->cluster->progress_user);
    if (rc != KVDEPOT_ENOTFOUND || !cr || !cr->model)
        return rc;
    int r = copy_model(x->cluster, m, cr->model);
    if (r)
        return r == 1 ? rc : r;
    return kvdepot__append(m, x->args, x->out, x->cluster->progress, x->cluster->progress_user);
}

int kvdepot__cluster_sequence_append(kvdepot_client *c, const kvdepot_append_args *a,
                                     kvdepot_sequence_info *out)
{
    if (!a)
        return kvdepot_sequence_append(NULL, a, out);
    struct append_ctx x = {a, out, c};
    return run_for_id(c, a->id, a->id_len, op_append, &x);
}

struct read_ctx {
    const kvdepot_read_args *args;
    kvdepot_read_result *out;
    const kvdepot_client *cluster; /* its progress callback */
};

static int op_read(kvdepot_client *m, void *p)
{
    struct read_ctx *x = p;
    return kvdepot__read(m, x->args, x->out, x->cluster->progress, x->cluster->progress_user);
}

int kvdepot__cluster_sequence_read(kvdepot_client *c, const kvdepot_read_args *a,
                                   kvdepot_read_result *out)
{
    if (!a)
        return kvdepot_sequence_read(NULL, a, out);
    struct read_ctx x = {a, out, c};
    return as_miss(c, run_for_id(c, a->id, a->id_len, op_read, &x));
}

/* ------------------------------------------------------------------------ */
/* Prefix lookup                                                             */
/* ------------------------------------------------------------------------ */

struct lookup_ctx {
    const char *model;
    const uint64_t *hashes;
    size_t n;
    uint64_t *blocks, *tokens;
};

static int op_lookup(kvdepot_client *m, void *p)
{
    struct lookup_ctx *x = p;
    return kvdepot_prefix_lookup(m, x->model, x->hashes, x->n, x->blocks, x->tokens);
}

/* A chain lives with its first block: the owner of the 16 hex digits of
 * hashes[0], which is also where ids tagged {those digits} live. An
 * unreachable owner is a miss: 0 blocks matched. */
int kvdepot__cluster_prefix_lookup(kvdepot_client *c, const char *model, const uint64_t *hashes,
                                   size_t n, uint64_t *matched_blocks, uint64_t *matched_tokens)
{
    char key[17] = "";
    if (hashes && n)
        snprintf(key, sizeof key, "%016llx", (unsigned long long)hashes[0]);
    struct lookup_ctx x = {model, hashes, n, matched_blocks, matched_tokens};
    int rc = run_keyed(c, (const uint8_t *)key, strlen(key), op_lookup, &x);
    if (rc == KVDEPOT_EUNAVAIL) {
        if (matched_blocks)
            *matched_blocks = 0;
        if (matched_tokens)
            *matched_tokens = 0;
        return KVDEPOT_OK;
    }
    return rc;
}

struct engine_lookup_ctx {
    const char *model;
    const kvdepot_engine_hashes *h;
    uint64_t *blocks, *tokens;
};

static int op_engine_lookup(kvdepot_client *m, void *p)
{
    struct engine_lookup_ctx *x = p;
    return kvdepot_engine_lookup(m, x->model, x->h, x->blocks, x->tokens);
}

/* An engine chain lives with the key of its first name (as prefix chains
 * with their first hash); an unreachable owner is a miss. */
int kvdepot__cluster_engine_lookup(kvdepot_client *c, const char *model,
                                   const kvdepot_engine_hashes *h, uint64_t *matched_blocks,
                                   uint64_t *matched_tokens)
{
    char key[17] = "";
    if (h->bytes && h->num && h->len)
        snprintf(key, sizeof key, "%016llx",
                 (unsigned long long)kvdepot_engine_hash_key(h->bytes, h->len));
    struct engine_lookup_ctx x = {model, h, matched_blocks, matched_tokens};
    int rc = run_keyed(c, (const uint8_t *)key, strlen(key), op_engine_lookup, &x);
    if (rc == KVDEPOT_EUNAVAIL) {
        if (matched_blocks)
            *matched_blocks = 0;
        if (matched_tokens)
            *matched_tokens = 0;
        return KVDEPOT_OK;
    }
    return rc;
}

/* ------------------------------------------------------------------------ */
/* Compute calls, pages and artifacts                                        */
/* ------------------------------------------------------------------------ */

/* Calls on one sequence go to its owner; an unreachable owner is a miss for
 * calls that read (NOT_FOUND, as for Read) and UNAVAILABLE for writes. */

struct plan_ctx {
    const void *id;
    size_t id_len;
    double bw, flops;
    uint32_t layer_start, num_layers;
    int assume;
    kvdepot_fetch_plan *out;
};

static int op_plan(kvdepot_client *m, void *p)
{
    struct plan_ctx *x = p;
    return kvdepot_plan_fetch(m, x->id, x->id_len, x->bw, x->flops, x->layer_start,
                              x->num_layers, x->assume, x->out);
}

int kvdepot__cluster_plan_fetch(kvdepot_client *c, const void *id, size_t id_len, double bw,
                                double flops, uint32_t layer_start, uint32_t num_layers,
                                int assume_activations, kvdepot_fetch_plan *out)
{
    struct plan_ctx x = {id, id_len, bw, flops, layer_start, num_layers, assume_activations, out};
    return as_miss(c, run_for_id(c, id, id_len, op_plan, &x));
}

struct search_ctx {
    const kvdepot_search_args *args;
    float scale;
    kvdepot_search_result *out;
    kvdepot_attend_result *attend; /* SparseAttend when set */
};

static int op_search(kvdepot_client *m, void *p)
{
    struct search_ctx *x = p;
    if (x->attend)
        return kvdepot_sparse_attend(m, x->args, x->scale, x->attend, x->out);
    return kvdepot_search(m, x->args, x->out);
}

int kvdepot__cluster_search(kvdepot_client *c, const kvdepot_search_args *a,
                            kvdepot_search_result *out)
{
    struct search_ctx x = {a, 0, out, NULL};
    return as_miss(c, run_for_id(c, a->id, a->id_len, op_search, &x));
}

int kvdepot__cluster_sparse_attend(kvdepot_client *c, const kvdepot_search_args *a, float scale,
                                   kvdepot_attend_result *out, kvdepot_search_result *tokens)
{
    struct search_ctx x = {a, scale, tokens, out};
    return as_miss(c, run_for_id(c, a->id, a->id_len, op_search, &x));
}

struct centroids_ctx {
    const void *id;
    size_t id_len;
    uint32_t layer;
    kvdepot_pq_centroids *out;
};

static int op_pq_centroids(kvdepot_client *m, void *p)
{
    struct centroids_ctx *x = p;
    return kvdepot_pq_centroids_get(m, x->id, x->id_len, x->layer, x->out);
}

int kvdepot__cluster_pq_centroids(kvdepot_client *c, const void *id, size_t id_len, uint32_t layer,
                                  kvdepot_pq_centroids *out)
{
    struct centroids_ctx x = {id, id_len, layer, out};
    return as_miss(c, run_for_id(c, id, id_len, op_pq_centroids, &x));
}

struct rebuild_ctx {
    const void *id;
    size_t id_len;
    uint32_t layer_start, num_layers;
    uint32_t *layers_rebuilt;
    uint64_t *tokens_indexed;
    kvdepot_sequence_info *info;
};

static int op_pq_rebuild(kvdepot_client *m, void *p)
{
    struct rebuild_ctx *x = p;
    return kvdepot_pq_rebuild(m, x->id, x->id_len, x->layer_start, x->num_layers, x->layers_rebuilt,
                              x->tokens_indexed, x->info);
}

int kvdepot__cluster_pq_rebuild(kvdepot_client *c, const void *id, size_t id_len,
                                uint32_t layer_start, uint32_t num_layers, uint32_t *layers_rebuilt,
                                uint64_t *tokens_indexed, kvdepot_sequence_info *info)
{
    struct rebuild_ctx x = {id,  id_len, layer_start, num_layers, layers_rebuilt, tokens_indexed,
                            info};
    return as_miss(c, run_for_id(c, id, id_len, op_pq_rebuild, &x));
}

struct pages_ctx {
    const kvdepot_read_args *read;
    kvdepot_page **pages;
    size_t *count;
    const kvdepot_append_pages_args *append;
    kvdepot_sequence_info *info;
};

static int op_read_pages(kvdepot_client *m, void *p)
{
    struct pages_ctx *x = p;
    return kvdepot_sequence_read_pages(m, x->read, x->pages, x->count);
}

static int op_append_pages(kvdepot_client *m, void *p)
{
    struct pages_ctx *x = p;
    return kvdepot_sequence_append_pages(m, x->append, x->info);
}

int kvdepot__cluster_read_pages(kvdepot_client *c, const kvdepot_read_args *a,
                                kvdepot_page **pages, size_t *count)
{
    struct pages_ctx x = {.read = a, .pages = pages, .count = count};
    return as_miss(c, run_for_id(c, a->id, a->id_len, op_read_pages, &x));
}

int kvdepot__cluster_append_pages(kvdepot_client *c, const kvdepot_append_pages_args *a,
                                  kvdepot_sequence_info *out)
{
    struct pages_ctx x = {.append = a, .info = out};
    return run_for_id(c, a->id, a->id_len, op_append_pages, &x);
}

/*
 * Attend: the queries are grouped by the owner of their sequence and every
 * group runs as one Attend on its server, the groups in parallel (one
 * thread each). Results land at their query's index. One group failing
 * fails the call: every result is freed and the first failing group's
 * status and message are returned (an unreachable server: NOT_FOUND).
 */
typedef struct attend_group {
    kvdepot_client *c;
    shard *s;
    uint32_t layer;
    float scale;
    kvdepot_dtype q_dtype;
    size_t n;
    size_t *index;                 /* positions in the caller's arrays */
    kvdepot_attend_query *queries; /* the group's queries, in order */
    kvdepot_attend_result *results;
    int rc;
    char msg[512];
    pthread_t thread;
    int started;
} attend_group;

struct attend_op_ctx {
    attend_group *g;
};

static int op_attend(kvdepot_client *m, void *p)
{
    attend_group *g = ((struct attend_op_ctx *)p)->g;
    return kvdepot_attend_dtype(m, g->layer, g->scale, g->q_dtype, g->queries, g->n, g->results);
}

static void *attend_group_run(void *p)
{
    attend_group *g = p;
    struct attend_op_ctx x = {g};
    g->rc = as_miss(g->c, run_on(g->c, g->s, op_attend, &x));
    if (g->rc)
        snprintf(g->msg, sizeof g->msg, "%s", kvdepot_errmsg(g->c));
    return NULL;
}

static void attend_groups_free(attend_group *g, size_t ng)
{
    for (size_t i = 0; i < ng; i++) {
        free(g[i].index);
        free(g[i].queries);
        free(g[i].results);
    }
    free(g);
}

int kvdepot__cluster_attend(kvdepot_client *c, uint32_t layer, float scale, kvdepot_dtype q_dtype,
                            const kvdepot_attend_query *queries, size_t n,
                            kvdepot_attend_result *out)
{
    shard **v;
    size_t ns = pick_all(c, &v);
    if (!ns) {
        free(v);
        return kvdepot__fail(c, KVDEPOT_EUNAVAIL, "attend: no server behind %s", c->address);
    }
    attend_group *g = calloc(ns, sizeof *g);
    size_t *owner = malloc(n * sizeof *owner);
    int rc = KVDEPOT_OK;
    if (!g || !owner) {
        rc = kvdepot__fail(c, KVDEPOT_ENOMEM, "attend: out of memory");
        goto done;
    }
    /* Owner of each query among the members taken above (one snapshot of
     * the member table, so a concurrent re-resolve cannot split a group). */
    for (size_t i = 0; i < n; i++) {
        const uint8_t *key;
        size_t klen;
        placement_key(queries[i].id, queries[i].id_len, &key, &klen);
        owner[i] = owner_index(v, ns, key, klen);
        g[owner[i]].n++;
    }
    for (size_t s = 0; s < ns && !rc; s++) {
        g[s].c = c;
        g[s].s = v[s];
        g[s].layer = layer;
        g[s].scale = scale;
        g[s].q_dtype = q_dtype;
        if (!g[s].n)
            continue;
        g[s].index = malloc(g[s].n * sizeof *g[s].index);
        g[s].queries = malloc(g[s].n * sizeof *g[s].queries);
        g[s].results = calloc(g[s].n, sizeof *g[s].results);
        if (!g[s].index || !g[s].queries || !g[s].results)
            rc = kvdepot__fail(c, KVDEPOT_ENOMEM, "attend: out of memory");
        g[s].n = 0; /* refilled below */
    }
    if (rc)
        goto done;
    for (size_t i = 0; i < n; i++) {
        attend_group *x = &g[owner[i]];
        x->index[x->n] = i;
        x->queries[x->n++] = queries[i];
    }
    /* The last group runs on this thread; the others get their own. */
    size_t last = ns;
    for (size_t s = 0; s < ns; s++)
        if (g[s].n)
            last = s;
    for (size_t s = 0; s < ns; s++) {
        if (!g[s].n || s == last)
            continue;
        if (pthread_create(&g[s].thread, NULL, attend_group_run, &g[s]) == 0)
            g[s].started = 1;
        else
            attend_group_run(&g[s]);
    }
    attend_group_run(&g[last]);
    for (size_t s = 0; s < ns; s++)
        if (g[s].started)
            pthread_join(g[s].thread, NULL);
    for (size_t s = 0; s < ns; s++)
        if (g[s].n && g[s].rc) {
            rc = kvdepot__fail(c, g[s].rc, "%s", g[s].msg);
            break;
        }
    for (size_t s = 0; s < ns; s++) {
        if (rc) {
            kvdepot_attend_results_free(g[s].results, g[s].rc ? 0 : g[s].n);
            continue;
        }
        for (size_t j = 0; j < g[s].n; j++)
            out[g[s].index[j]] = g[s].results[j];
    }
    if (!rc)
        kvdepot__clear_error();
done:
    if (g)
        attend_groups_free(g, ns);
    free(owner);
    release_all(c, v, ns);
    return rc;
}

struct artifacts_ctx {
    const char *model;
    const kvdepot_artifact *in;
    size_t n;
    uint32_t stored;
    const int *kinds;
    size_t nkinds;
    kvdepot_artifact *out;
    size_t count;
    const kvdepot_calibrate_args *cal;
    const kvdepot_calibrate_sample *samples;
    kvdepot_calibrate_result *result;
};

static int op_artifacts_put(kvdepot_client *m, void *p)
{
    struct artifacts_ctx *x = p;
    return kvdepot_artifacts_upload(m, x->model, x->in, x->n, &x->stored);
}

static int op_artifacts_get(kvdepot_client *m, void *p)
{
    struct artifacts_ctx *x = p;
    return kvdepot_artifacts_get(m, x->model, x->kinds, x->nkinds, &x->out, &x->count);
}

static int op_calibrate(kvdepot_client *m, void *p)
{
    struct artifacts_ctx *x = p;
    return kvdepot_calibrate(m, x->cal, x->samples, x->n, x->result);
}

/* Upload to every member but `skip` (NULL: all), as model writes do:
 * unreachable members are skipped, the first real error is returned, and
 * UNAVAILABLE only when no member took them. */
static int artifacts_broadcast(kvdepot_client *c, shard **v, size_t n, const shard *skip,
                               const char *model, const kvdepot_artifact *a, size_t count,
                               uint32_t *stored)
{
    int err = KVDEPOT_OK, any = 0;
    char msg[512] = "";
    for (size_t i = 0; i < n; i++) {
        if (v[i] == skip)
            continue;
        struct artifacts_ctx x = {.model = model, .in = a, .n = count};
        int rc = run_on(c, v[i], op_artifacts_put, &x);
        if (rc == KVDEPOT_OK) {
            if (stored && !any)
                *stored = x.stored;
            any = 1;
        } else if (rc != KVDEPOT_EUNAVAIL && !err) {
            err = rc;
            snprintf(msg, sizeof msg, "%s", kvdepot_errmsg(c));
        }
    }
    if (err)
        return kvdepot__fail(c, err, "%s", msg);
    if (!any && skip == NULL)
        return kvdepot__fail(c, KVDEPOT_EUNAVAIL, "upload artifacts: no server behind %s answered",
                             c->address);
    return KVDEPOT_OK;
}

int kvdepot__cluster_artifacts_upload(kvdepot_client *c, const char *model,
                                      const kvdepot_artifact *a, size_t count, uint32_t *stored)
{
    shard **v;
    size_t n = pick_all(c, &v);
    int rc = artifacts_broadcast(c, v, n, NULL, model, a, count, stored);
    release_all(c, v, n);
    if (!rc)
        kvdepot__clear_error();
    return rc;
}

int kvdepot__cluster_artifacts_get(kvdepot_client *c, const char *model, const int *kinds,
                                   size_t nkinds, kvdepot_artifact **out, size_t *count)
{
    shard **v;
    size_t n = pick_for_model(c, model, &v);
    int rc = KVDEPOT_EUNAVAIL, seen = KVDEPOT_EUNAVAIL;
    for (size_t i = 0; i < n; i++) {
        struct artifacts_ctx x = {.model = model, .kinds = kinds, .nkinds = nkinds};
        rc = run_on(c, v[i], op_artifacts_get, &x);
        if (rc == KVDEPOT_OK) {
            *out = x.out;
            *count = x.count;
            break;
        }
        if (rc != KVDEPOT_ENOTFOUND && rc != KVDEPOT_EUNAVAIL)
            break;
        if (rc == KVDEPOT_ENOTFOUND)
            seen = rc;
    }
    release_all(c, v, n);
    if (rc == KVDEPOT_EUNAVAIL && seen == KVDEPOT_ENOTFOUND)
        return kvdepot__fail(c, KVDEPOT_ENOTFOUND, "get artifacts: no model \"%s\"", model);
    if (rc == KVDEPOT_EUNAVAIL && n == 0)
        return kvdepot__fail(c, KVDEPOT_EUNAVAIL, "no server behind %s", c->address);
    return rc;
}

/*
 * Calibrate runs once, on the first reachable member in the model name's
 * rendezvous order; the artifacts it stored are then copied to every other
 * reachable member, so sequences created anywhere find them. A member that
 * was down misses them (CreateSequence with a VQ or SVD codec there answers
 * FAILED_PRECONDITION until the artifacts are uploaded again).
 */
int kvdepot__cluster_calibrate(kvdepot_client *c, const kvdepot_calibrate_args *a,
                               const kvdepot_calibrate_sample *samples, size_t count,
                               kvdepot_calibrate_result *out)
{
    shard **v;
    size_t n = pick_for_model(c, a->model, &v);
    int rc = KVDEPOT_EUNAVAIL;
    size_t at = n;
    for (size_t i = 0; i < n; i++) {
        struct artifacts_ctx x = {.cal = a, .samples = samples, .n = count, .result = out};
        rc = run_on(c, v[i], op_calibrate, &x);
        if (rc != KVDEPOT_EUNAVAIL) {
            at = i;
            break;
        }
    }
    if (rc == KVDEPOT_OK && n > 1) {
        struct artifacts_ctx x = {.model = a->model};
        rc = run_on(c, v[at], op_artifacts_get, &x);
        if (rc == KVDEPOT_OK) {
            rc = artifacts_broadcast(c, v, n, v[at], a->model, x.out, x.count, NULL);
            kvdepot_artifacts_free(x.out, x.count);
        }
        if (rc) {
            char msg[512];
            snprintf(msg, sizeof msg, "%s", kvdepot_errmsg(c));
            kvdepot_calibrate_result_clear(out);
            rc = kvdepot__fail(c, rc, "calibrate: trained on %s, copying the artifacts failed: %s",
                               v[at]->name, msg);
        }
    }
    release_all(c, v, n);
    if (rc == KVDEPOT_EUNAVAIL && n == 0)
        return kvdepot__fail(c, KVDEPOT_EUNAVAIL, "no server behind %s", c->address);
    if (!rc)
        kvdepot__clear_error();
    return rc;
}

/* ------------------------------------------------------------------------ */
/* Public: inspecting the placement                                          */
/* ------------------------------------------------------------------------ */

size_t kvdepot_shard_count(kvdepot_client *c)
{
    if (!c)
        return 0;
    if (!c->cluster)
        return 1;
    maybe_resolve(c);
    pthread_mutex_lock(&c->cluster->mu);
    size_t n = c->cluster->n;
    pthread_mutex_unlock(&c->cluster->mu);
    return n;
}

static int copy_out(kvdepot_client *c, const char *name, char *buf, size_t cap)
{
    if (!buf || cap == 0)
        return kvdepot__fail(c, KVDEPOT_EINVAL, "shard: no buffer");
    if (strlen(name) >= cap) {
        buf[0] = '\0';
        return kvdepot__fail(c, KVDEPOT_EINVAL, "shard: endpoint name longer than %zu bytes",
                             cap - 1);
    }
    strcpy(buf, name);
    return KVDEPOT_OK;
}

int kvdepot_shard_endpoint(kvdepot_client *c, size_t index, char *buf, size_t cap)
{
    kvdepot__clear_error();
    if (!c)
        return kvdepot__fail(NULL, KVDEPOT_EINVAL, "shard endpoint: client is NULL");
    if (!c->cluster) {
        if (index != 0)
            return kvdepot__fail(c, KVDEPOT_ERANGE, "shard endpoint: index %zu of 1", index);
        return copy_out(c, c->address, buf, cap);
    }
    char name[ENDPOINT_MAX] = "";
    pthread_mutex_lock(&c->cluster->mu);
    size_t n = c->cluster->n;
    if (index < n)
        snprintf(name, sizeof name, "%s", c->cluster->shards[index]->name);
    pthread_mutex_unlock(&c->cluster->mu);
    if (index >= n)
        return kvdepot__fail(c, KVDEPOT_ERANGE, "shard endpoint: index %zu of %zu", index, n);
    return copy_out(c, name, buf, cap);
}

int kvdepot_shard_owner(kvdepot_client *c, const void *id, size_t id_len, char *buf, size_t cap)
{
    kvdepot__clear_error();
    if (!c || (!id && id_len))
        return kvdepot__fail(c, KVDEPOT_EINVAL, "shard owner: NULL argument");
    if (!c->cluster)
        return copy_out(c, c->address, buf, cap);
    const uint8_t *key;
    size_t klen;
    placement_key(id, id_len, &key, &klen);
    shard *s = pick(c, key, klen);
    if (!s)
        return kvdepot__fail(c, KVDEPOT_EUNAVAIL, "no server behind %s", c->address);
    int rc = copy_out(c, s->name, buf, cap);
    release(c, s);
    return rc;
}

int kvdepot_shard_refresh(kvdepot_client *c)
{
    kvdepot__clear_error();
    if (!c)
        return kvdepot__fail(NULL, KVDEPOT_EINVAL, "shard refresh: client is NULL");
    if (!c->cluster || !c->cluster->has_dns)
        return KVDEPOT_OK;
    pthread_mutex_lock(&c->cluster->mu);
    c->cluster->next_resolve = 0;
    pthread_mutex_unlock(&c->cluster->mu);
    maybe_resolve(c);
    return KVDEPOT_OK;
}

int kvdepot_shard_prefix_tag(uint64_t first_block_hash, char *buf, size_t cap)
{
    kvdepot__clear_error();
    if (!buf || cap < 19)
        return kvdepot__fail(NULL, KVDEPOT_EINVAL, "shard prefix tag: buffer needs 19 bytes");
    snprintf(buf, cap, "{%016llx}", (unsigned long long)first_block_hash);
    return KVDEPOT_OK;
}
