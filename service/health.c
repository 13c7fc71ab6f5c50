/*
 * grpc.health.v1.Health. The server as a whole and the kvdepot service share
 * one state, the service's readiness: NOT_SERVING while starting, SERVING
 * once ready, NOT_SERVING again from the start of shutdown, and for good
 * once the GPU the store was opened with is unusable (the service goes on
 * answering from the CPU, but should be replaced) or the store cannot write
 * (kvdepotd then exits, see main.c). No token needed.
 */
#include <stdlib.h>
#include <string.h>

#include "convert.h"
#include "grpc/health/v1/health.pb-c.h"
#include "rpc.h"

typedef Grpc__Health__V1__HealthCheckResponse__ServingStatus serving_status;

static int known_service(const char *name)
{
    return !name || name[0] == '\0' || strcmp(name, "kvdepot.v1.KVDepot") == 0;
}

static serving_status current(kvd_req_ctx *ctx)
{
    return atomic_load(&ctx->svc->serving) && kvd_service_store_ok(ctx->svc->store)
               ? GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING
               : GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__NOT_SERVING;
}

static grpc_byte_buffer *pack_status(serving_status st)
{
    Grpc__Health__V1__HealthCheckResponse resp = GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__INIT;
    resp.status = st;
    return kvd_pack(&resp.base);
}

int kvd_h_health_check(kvd_req_ctx *ctx, const ProtobufCMessage *msg, grpc_byte_buffer **reply,
                       kvd_error *err)
{
    const Grpc__Health__V1__HealthCheckRequest *req =
        (const Grpc__Health__V1__HealthCheckRequest *)msg;
    if (!known_service(req->service))
        return kvd_error_set(err, KVD_ENOTFOUND, "service: '%.200s' is not served here",
                             req->service);
    *reply = pack_status(current(ctx));
    return 0;
}

/* Watch sends the current state once and then holds the call open; the
 * server cancels held calls when it shuts down, which is the only change of
 * state there is. Unknown services get SERVICE_UNKNOWN in the stream, as the
 * health protocol asks, not an error status. */
typedef struct watch_state {
    int sent;
    int unknown;
} watch_state;

static int watch_start(kvd_req_ctx *ctx, const ProtobufCMessage *msg, void **state,
                       kvd_error *err)
{
    (void)ctx;
    const Grpc__Health__V1__HealthCheckRequest *req =
        (const Grpc__Health__V1__HealthCheckRequest *)msg;
    watch_state *w = calloc(1, sizeof *w);
    if (!w)
        return kvd_error_set(err, KVD_ENOMEM, "out of memory");
    w->unknown = !known_service(req->service);
    *state = w;
    return 0;
}

static int watch_next(kvd_req_ctx *ctx, void *state, grpc_byte_buffer **msg, kvd_error *err)
{
    watch_state *w = state;
    *msg = NULL;
    if (w->sent)
        return KVD_STREAM_HOLD;
    w->sent = 1;
    *msg = pack_status(w->unknown
                           ? GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVICE_UNKNOWN
                           : current(ctx));
    if (!*msg)
        return kvd_error_set(err, KVD_ENOMEM, "out of memory");
    return 0;
}

/* At shutdown a watcher of a known service learns NOT_SERVING before the
 * stream ends. */
static grpc_byte_buffer *watch_last(kvd_req_ctx *ctx, void *state)
{
    (void)ctx;
    watch_state *w = state;
    if (w->unknown)
        return NULL;
    return pack_status(GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__NOT_SERVING);
}

static void watch_release(void *state) { free(state); }

const kvd_stream_ops kvd_health_watch_ops = {
    .start = watch_start,
    .next = watch_next,
    .last = watch_last,
    .release = watch_release,
};
