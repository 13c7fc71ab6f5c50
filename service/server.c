/*
 * The server loop.
 *
 * Each worker thread owns one completion queue, registered on the server, and
 * keeps REQUESTS_PER_WORKER generic call requests outstanding on it. Every
 * call, from the moment it is requested, is a `kvd_call` whose address is
 * the completion-queue tag of its operations, and whose `state` says which
 * operation is in flight:
 *
 *   REQUESTED --(call arrives)--> RECV_REQUEST  (unary, server streaming)
 *                                 RECV_STREAM   (client streaming; loops)
 *   RECV_REQUEST --> FINISHING                  (unary: reply + status)
 *                --> SENDING <-> SENDING        (server streaming, one send
 *                               in flight, the next message prepared)
 *                --> HOLDING                    (nothing to send until close)
 *   RECV_STREAM  --(half-close)--> FINISHING
 *   FINISHING --(status sent)--> done
 *
 * Besides that main chain, every call has one RECV_CLOSE_ON_SERVER op
 * outstanding from the start, so cancellation is noticed. Its tag is the call
 * address with the low bit set (calls are malloc'd, so the bit is free). A
 * call is freed when both the main chain and the close op are done. All
 * completions of a call arrive on its worker's queue and only that worker
 * touches the struct, so no locking is needed per call.
 */
#include "server.h"

#include "kvdepot/backend.h"

#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <grpc/byte_buffer.h>
#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/slice.h>
#include <grpc/support/alloc.h>
#include <grpc/support/time.h>

#include <arpa/inet.h>
#include <errno.h>
#include <grpc/grpc_security.h>

#include "convert.h"
#include "log.h"
#include "metrics.h"

#define REQUESTS_PER_WORKER 8

enum call_state {
    CALL_REQUESTED,
    CALL_RECV_REQUEST,
    CALL_RECV_STREAM,
    CALL_SENDING,
    CALL_HOLDING,
    CALL_FINISHING,
    CALL_DONE,
};

typedef struct worker worker;

typedef struct kvd_call {
    enum call_state state;
    worker *w;
    grpc_call *call;
    grpc_call_details details;
    grpc_metadata_array request_md;
    const kvd_method *method;
    kvd_req_ctx ctx;
    struct timespec t0;

    int main_done;     /* the main chain has ended */
    int close_pending; /* RECV_CLOSE_ON_SERVER outstanding */
    int cancelled;     /* set by RECV_CLOSE_ON_SERVER */
    int md_sent;       /* initial metadata went out */

    grpc_byte_buffer *recv_msg;
    grpc_byte_buffer *send_msg; /* in flight */
    grpc_byte_buffer *next_msg; /* prepared, sent when the current send ends */
    void *stream_state;
    int stream_end;   /* next() said there is nothing more */
    int stream_hold;  /* ... and wants the call held open */
    int stream_rc;    /* an error next() reported, sent after the current send */
    kvd_error stream_err;

    int status; /* final kvd status */
    grpc_slice status_details;
    int have_details;
    uint64_t bytes_in, bytes_out;

    /* Held calls (CALL_HOLDING) sit in a list so that shutdown can end them.
     * `held` and the links are guarded by the server mutex: whichever of the
     * worker (close op) and the shutdown thread takes a call off the list
     * owns its ending. */
    int held;
    int end_on_close; /* the close op ends the main chain (see finish_held) */
    struct kvd_call *hold_prev, *hold_next;
} kvd_call;

struct worker {
    kvd_server *srv;
    grpc_completion_queue *cq;
    pthread_t thread;
    int started;
    int armed; /* its first calls are requested (under the server's mu) */
};

struct kvd_server {
    kvd_service *svc;
    grpc_server *server;
    worker *workers;
    size_t nworkers;
    atomic_int shutting_down;
    atomic_uint_fast64_t next_req_id;

    pthread_mutex_t mu; /* guards live and the held list */
    pthread_cond_t cv;
    size_t live;        /* kvd_call structs allocated */
    kvd_call *held;
};

/* ---- call lifetime ------------------------------------------------------ */

static void live_add(kvd_server *s, int delta)
{
    pthread_mutex_lock(&s->mu);
    s->live += (size_t)delta;
    if (s->live == 0)
        pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

/* Take c off the held list; the caller holds the mutex. */
static void hold_remove(kvd_server *s, kvd_call *c)
{
    if (c->hold_prev)
        c->hold_prev->hold_next = c->hold_next;
    else
        s->held = c->hold_next;
    if (c->hold_next)
        c->hold_next->hold_prev = c->hold_prev;
    c->hold_prev = c->hold_next = NULL;
    c->held = 0;
}

static void finish_held(kvd_call *c);

static void hold_link(kvd_call *c)
{
    kvd_server *s = c->w->srv;
    pthread_mutex_lock(&s->mu);
    c->hold_prev = NULL;
    c->hold_next = s->held;
    if (s->held)
        s->held->hold_prev = c;
    s->held = c;
    c->held = 1;
    /* Shutdown may have swept the list just before we joined it. */
    if (atomic_load(&s->shutting_down)) {
        hold_remove(s, c);
        finish_held(c);
    }
    pthread_mutex_unlock(&s->mu);
}

static double elapsed_ms(const struct timespec *t0)
{
    struct timespec t1;
    clock_gettime(CLOCK_MONOTONIC, &t1);
    return (double)(t1.tv_sec - t0->tv_sec) * 1e3 + (double)(t1.tv_nsec - t0->tv_nsec) / 1e6;
}

static void count_call(kvd_call *c, double ms)
{
    kvd_metrics_observe(c->method ? (int)(c->method - kvd_methods) : -1, c->status, ms / 1e3);
    KVD_METRIC_ADD(bytes_received_total, c->bytes_in);
    KVD_METRIC_ADD(bytes_sent_total, c->bytes_out);
    KVD_METRIC_ADD(calls_in_flight, -1);
    if (c->status == KVD_ECORRUPT)
        KVD_METRIC_ADD(checksum_failures_total, 1);
    else if (c->status == KVD_EAUTH)
        KVD_METRIC_ADD(auth_failures_total, 1);
    else if (c->status == KVD_EPERM)
        KVD_METRIC_ADD(permission_denied_total, 1);
}

static void log_call(kvd_call *c)
{
    const char *method = c->method ? c->method->name : "unknown";
    double ms = elapsed_ms(&c->t0);
    count_call(c, ms);
    /* The tenant, never the token: tokens are secrets, tenants are not. */
    char tenant[140];
    kvd_log_quote(tenant, sizeof tenant, kvd_auth_tenant(c->ctx.auth, c->ctx.principal),
                  strlen(kvd_auth_tenant(c->ctx.auth, c->ctx.principal)));
    if (c->status == 0) {
        KVD_LOG(KVD_LOG_DEBUG, NULL,
                "req=%" PRIu64 " method=%s tenant=%s status=OK bytes_in=%" PRIu64
                " bytes_out=%" PRIu64 " ms=%.3f",
                c->ctx.req_id, method, tenant, c->bytes_in, c->bytes_out, ms);
        return;
    }
    if (KVD_LOG_WARN < kvd_log_threshold)
        return;
    char *msg = c->have_details ? grpc_slice_to_c_string(c->status_details) : NULL;
    char path[160];
    size_t plen = 0;
    if (!c->method)
        plen = kvd_log_quote(path, sizeof path, (const char *)GRPC_SLICE_START_PTR(c->details.method),
                             GRPC_SLICE_LENGTH(c->details.method));
    kvd_log_write(KVD_LOG_WARN, msg ? msg : kvd_strerror(c->status),
                  "req=%" PRIu64 " method=%s%s%.*s tenant=%s status=%s bytes_in=%" PRIu64
                  " bytes_out=%" PRIu64 " ms=%.3f",
                  c->ctx.req_id, method, plen ? " path=" : "", (int)plen, path, tenant,
                  kvd_status_name(c->status), c->bytes_in, c->bytes_out, ms);
    gpr_free(msg);
}

static void call_free(kvd_call *c)
{
    kvd_server *s = c->w->srv;
    if (c->method && c->method->stream && c->method->stream->release)
        c->method->stream->release(c->stream_state);
    if (c->recv_msg)
        grpc_byte_buffer_destroy(c->recv_msg);
    if (c->send_msg)
        grpc_byte_buffer_destroy(c->send_msg);
    if (c->next_msg)
        grpc_byte_buffer_destroy(c->next_msg);
    if (c->have_details)
        grpc_slice_unref(c->status_details);
    if (c->call)
        grpc_call_unref(c->call);
    kvd_auth_unref(c->ctx.auth);
    grpc_call_details_destroy(&c->details);
    grpc_metadata_array_destroy(&c->request_md);
    free(c);
    live_add(s, -1);
}

/* The main chain ended: log once and free when the close op is in too. */
static void main_end(kvd_call *c)
{
    c->state = CALL_DONE;
    c->main_done = 1;
    log_call(c);
    if (!c->close_pending)
        call_free(c);
}

/* ---- requesting calls --------------------------------------------------- */

static void request_one(worker *w)
{
    kvd_server *s = w->srv;
    kvd_call *c = calloc(1, sizeof *c);
    if (!c) {
        KVD_LOG(KVD_LOG_ERROR, "out of memory requesting a call", "worker=%zu",
                (size_t)(w - s->workers));
        return;
    }
    c->w = w;
    c->state = CALL_REQUESTED;
    grpc_call_details_init(&c->details);
    grpc_metadata_array_init(&c->request_md);
    live_add(s, 1);
    grpc_call_error e =
        grpc_server_request_call(s->server, &c->call, &c->details, &c->request_md, w->cq, w->cq, c);
    if (e != GRPC_CALL_OK) {
        KVD_LOG(KVD_LOG_ERROR, "grpc_server_request_call failed", "error=%d", (int)e);
        grpc_call_details_destroy(&c->details);
        grpc_metadata_array_destroy(&c->request_md);
        free(c);
        live_add(s, -1);
    }
}

/* ---- ops ---------------------------------------------------------------- */

static int start_batch(kvd_call *c, grpc_op *ops, size_t n, void *tag)
{
    grpc_call_error e = grpc_call_start_batch(c->call, ops, n, tag, NULL);
    if (e != GRPC_CALL_OK) {
        KVD_LOG(KVD_LOG_ERROR, "grpc_call_start_batch failed",
                "req=%" PRIu64 " error=%d state=%d", c->ctx.req_id, (int)e, (int)c->state);
        return -1;
    }
    return 0;
}

static void add_initial_md(kvd_call *c, grpc_op *ops, size_t *n)
{
    if (c->md_sent)
        return;
    memset(&ops[*n], 0, sizeof ops[*n]);
    ops[*n].op = GRPC_OP_SEND_INITIAL_METADATA;
    (*n)++;
    c->md_sent = 1;
}

/* Start the batch sending the final status (and the reply, if any); takes
 * ownership of reply. Returns start_batch's result. */
static int start_finish(kvd_call *c, int status, const char *details, grpc_byte_buffer *reply)
{
    grpc_op ops[3];
    size_t n = 0;
    c->status = status;
    add_initial_md(c, ops, &n);
    if (reply) {
        c->send_msg = reply;
        c->bytes_out += grpc_byte_buffer_length(reply);
        memset(&ops[n], 0, sizeof ops[n]);
        ops[n].op = GRPC_OP_SEND_MESSAGE;
        ops[n].data.send_message.send_message = reply;
        n++;
    }
    memset(&ops[n], 0, sizeof ops[n]);
    ops[n].op = GRPC_OP_SEND_STATUS_FROM_SERVER;
    ops[n].data.send_status_from_server.status = (grpc_status_code)kvd_status_to_grpc(status);
    if (status != 0) {
        const char *d = details && details[0] ? details : kvd_strerror(status);
        c->status_details = grpc_slice_from_copied_string(d);
        c->have_details = 1;
        ops[n].data.send_status_from_server.status_details = &c->status_details;
    }
    n++;
    c->state = CALL_FINISHING;
    return start_batch(c, ops, n, c);
}

static void finish(kvd_call *c, int status, const char *details, grpc_byte_buffer *reply)
{
    if (start_finish(c, status, details, reply) != 0)
        main_end(c);
}

/* End a held stream at shutdown: the handler's last word (health Watch sends
 * NOT_SERVING), then UNAVAILABLE. Called with the server mutex held, right
 * after the call left the held list: from then on its worker leaves the main
 * chain alone (on_close sees held == 0), and the batch's completion hands it
 * back. Should the batch not start, the call is cancelled and its close op
 * ends it instead. */
static void finish_held(kvd_call *c)
{
    grpc_byte_buffer *last = NULL;
    if (c->method->stream->last)
        last = c->method->stream->last(&c->ctx, c->stream_state);
    if (start_finish(c, KVD_EUNAVAIL, "server shutting down", last) != 0) {
        c->end_on_close = 1;
        grpc_call_cancel_with_status(c->call, GRPC_STATUS_UNAVAILABLE, "server shutting down",
                                     NULL);
    }
}

static void finish_err(kvd_call *c, const kvd_error *err, int rc)
{
    finish(c, rc, err && err->code ? err->msg : NULL, NULL);
}

static void recv_message(kvd_call *c, enum call_state next)
{
    grpc_op op;
    memset(&op, 0, sizeof op);
    op.op = GRPC_OP_RECV_MESSAGE;
    op.data.recv_message.recv_message = &c->recv_msg;
    c->state = next;
    if (start_batch(c, &op, 1, c) != 0)
        main_end(c);
}

/* ---- server streaming -------------------------------------------------- */

static void stream_prepare(kvd_call *c)
{
    if (c->next_msg || c->stream_end)
        return;
    kvd_error_clear(&c->stream_err);
    grpc_byte_buffer *m = NULL;
    int rc = c->method->stream->next(&c->ctx, c->stream_state, &m, &c->stream_err);
    if (rc < 0) {
        c->stream_rc = rc;
        c->stream_end = 1;
    } else if (rc == KVD_STREAM_HOLD) {
        c->stream_hold = 1;
        c->stream_end = 1;
    } else if (!m) {
        c->stream_end = 1;
    } else {
        c->next_msg = m;
    }
}

/* Send the prepared message, then prepare the one after it while the send is
 * in flight; or end the stream. */
static void stream_pump(kvd_call *c)
{
    stream_prepare(c);
    if (c->next_msg) {
        grpc_op ops[2];
        size_t n = 0;
        add_initial_md(c, ops, &n);
        c->send_msg = c->next_msg;
        c->next_msg = NULL;
        c->bytes_out += grpc_byte_buffer_length(c->send_msg);
        memset(&ops[n], 0, sizeof ops[n]);
        ops[n].op = GRPC_OP_SEND_MESSAGE;
        ops[n].data.send_message.send_message = c->send_msg;
        n++;
        c->state = CALL_SENDING;
        if (start_batch(c, ops, n, c) != 0) {
            main_end(c);
            return;
        }
        stream_prepare(c);
        return;
    }
    if (c->stream_rc) {
        finish_err(c, &c->stream_err, c->stream_rc);
    } else if (c->stream_hold) {
        c->state = CALL_HOLDING;
        hold_link(c);
    } else {
        finish(c, 0, NULL, NULL);
    }
}

/* ---- the state machine -------------------------------------------------- */

/* Authenticate the call from its metadata and check the token's access
 * against the method's; model namespaces are checked by the handlers, which
 * know the model. On failure the call is finished here and -1 returned. */
static int authorize(kvd_call *c)
{
    kvd_error err;
    kvd_error_clear(&err);
    c->ctx.auth = kvd_service_auth(c->ctx.svc);
    int rc = kvd_auth_check(c->ctx.auth, &c->request_md, (int64_t)time(NULL), &c->ctx.principal,
                            &err);
    if (rc == 0 && c->ctx.principal && c->ctx.principal->read_only &&
        c->method->access == KVD_ACCESS_WRITE)
        rc = kvd_error_set(&err, KVD_EPERM, "tenant %s: token is read-only, %s writes",
                           kvd_auth_tenant(c->ctx.auth, c->ctx.principal), c->method->name);
    if (rc == 0)
        return 0;
    finish(c, rc, err.msg, NULL);
    return -1;
}

static void on_call_arrived(kvd_call *c)
{
    kvd_server *s = c->w->srv;
    clock_gettime(CLOCK_MONOTONIC, &c->t0);
    KVD_METRIC_ADD(calls_in_flight, 1);
    c->ctx.svc = s->svc;
    c->ctx.req_id = atomic_fetch_add(&s->next_req_id, 1) + 1;
    c->ctx.deadline = c->details.deadline;
    c->method = kvd_method_find((const char *)GRPC_SLICE_START_PTR(c->details.method),
                                GRPC_SLICE_LENGTH(c->details.method));

    grpc_op op;
    memset(&op, 0, sizeof op);
    op.op = GRPC_OP_RECV_CLOSE_ON_SERVER;
    op.data.recv_close_on_server.cancelled = &c->cancelled;
    if (start_batch(c, &op, 1, (void *)((uintptr_t)c | 1)) == 0)
        c->close_pending = 1;

    if (!c->method) {
        char msg[256];
        snprintf(msg, sizeof msg, "unknown method %.*s",
                 (int)(GRPC_SLICE_LENGTH(c->details.method) < 200
                           ? GRPC_SLICE_LENGTH(c->details.method)
                           : 200),
                 (const char *)GRPC_SLICE_START_PTR(c->details.method));
        finish(c, KVD_EUNSUPP, msg, NULL);
        return;
    }
    if (c->method->access != KVD_ACCESS_OPEN && authorize(c) != 0)
        return;
    recv_message(c, c->method->kind == KVD_RPC_CLIENT_STREAM ? CALL_RECV_STREAM
                                                              : CALL_RECV_REQUEST);
}

static void on_request(kvd_call *c, int ok)
{
    const kvd_method *m = c->method;
    grpc_byte_buffer *bb = c->recv_msg;
    c->recv_msg = NULL;
    if (!ok || !bb) {
        if (bb)
            grpc_byte_buffer_destroy(bb);
        if (!ok)
            finish(c, KVD_CANCELLED, "call ended before the request arrived", NULL);
        else
            finish(c, KVD_EINVAL, "request message missing", NULL);
        return;
    }
    c->bytes_in += grpc_byte_buffer_length(bb);
    kvd_error err;
    kvd_error_clear(&err);
    ProtobufCMessage *req = kvd_bb_unpack(m->request, bb, &err);
    grpc_byte_buffer_destroy(bb);
    if (!req) {
        char msg[sizeof err.msg + 64];
        if (err.code)
            snprintf(msg, sizeof msg, "%s", err.msg);
        else
            snprintf(msg, sizeof msg, "%s: request message does not parse", m->request->short_name);
        finish(c, KVD_EINVAL, msg, NULL);
        return;
    }
    if (m->kind == KVD_RPC_UNARY) {
        grpc_byte_buffer *reply = NULL;
        int rc = m->unary(&c->ctx, req, &reply, &err);
        protobuf_c_message_free_unpacked(req, NULL);
        if (rc < 0) {
            if (reply)
                grpc_byte_buffer_destroy(reply);
            finish_err(c, &err, rc);
        } else {
            finish(c, 0, NULL, reply);
        }
        return;
    }
    int rc = m->stream->start(&c->ctx, req, &c->stream_state, &err);
    protobuf_c_message_free_unpacked(req, NULL);
    if (rc < 0) {
        finish_err(c, &err, rc);
        return;
    }
    stream_pump(c);
}

static void on_stream_message(kvd_call *c, int ok)
{
    const kvd_method *m = c->method;
    grpc_byte_buffer *bb = c->recv_msg;
    c->recv_msg = NULL;
    kvd_error err;
    kvd_error_clear(&err);
    if (!ok) {
        if (bb)
            grpc_byte_buffer_destroy(bb);
        finish(c, KVD_CANCELLED, "stream broken before it ended", NULL);
        return;
    }
    if (!bb && !c->close_pending && c->cancelled) {
        /* A cancelled stream also ends with "no message"; when the close op
         * has already told us so, do not mistake it for a half-close. */
        finish(c, KVD_CANCELLED, "client cancelled the stream", NULL);
        return;
    }
    if (!bb) { /* half-close: the client sent everything */
        grpc_byte_buffer *reply = NULL;
        int rc = m->stream->finish(&c->ctx, &c->stream_state, &reply, &err);
        if (rc < 0) {
            if (reply)
                grpc_byte_buffer_destroy(reply);
            finish_err(c, &err, rc);
        } else {
            finish(c, 0, NULL, reply);
        }
        return;
    }
    c->bytes_in += grpc_byte_buffer_length(bb);
    int rc = m->stream->recv(&c->ctx, &c->stream_state, bb, &err);
    grpc_byte_buffer_destroy(bb);
    if (rc < 0) {
        finish_err(c, &err, rc);
        return;
    }
    recv_message(c, CALL_RECV_STREAM);
}

static void on_event(kvd_call *c, int ok)
{
    switch (c->state) {
    case CALL_REQUESTED:
        if (!ok) { /* the server is shutting down */
            grpc_call_details_destroy(&c->details);
            grpc_metadata_array_destroy(&c->request_md);
            kvd_server *s = c->w->srv;
            free(c);
            live_add(s, -1);
            return;
        }
        if (!atomic_load(&c->w->srv->shutting_down))
            request_one(c->w);
        on_call_arrived(c);
        return;
    case CALL_RECV_REQUEST:
        on_request(c, ok);
        return;
    case CALL_RECV_STREAM:
        on_stream_message(c, ok);
        return;
    case CALL_SENDING:
        grpc_byte_buffer_destroy(c->send_msg);
        c->send_msg = NULL;
        if (!ok) {
            finish(c, KVD_CANCELLED, "client went away during the stream", NULL);
            return;
        }
        stream_pump(c);
        return;
    case CALL_FINISHING:
        if (c->send_msg) {
            grpc_byte_buffer_destroy(c->send_msg);
            c->send_msg = NULL;
        }
        if (!ok && c->status == 0)
            c->status = KVD_CANCELLED;
        main_end(c);
        return;
    case CALL_HOLDING:
    case CALL_DONE:
        break;
    }
    KVD_LOG(KVD_LOG_ERROR, "completion in an unexpected call state",
            "req=%" PRIu64 " state=%d", c->ctx.req_id, (int)c->state);
}

static void on_close(kvd_call *c)
{
    kvd_server *s = c->w->srv;
    c->close_pending = 0;
    pthread_mutex_lock(&s->mu);
    int was_held = c->held;
    if (was_held)
        hold_remove(s, c);
    pthread_mutex_unlock(&s->mu);
    if (was_held || c->end_on_close) {
        /* The client left a held stream: there is no status left to send. */
        if (was_held)
            c->status = KVD_CANCELLED;
        main_end(c);
        return;
    }
    /* Otherwise the main chain is running (perhaps a shutdown's final batch)
     * and frees the call when it ends. */
    if (c->main_done)
        call_free(c);
}

static void *worker_main(void *arg)
{
    worker *w = arg;
    kvd_server *s = w->srv;
    for (int i = 0; i < REQUESTS_PER_WORKER; i++)
        request_one(w);
    /* Shutdown waits for this: it must not destroy the server while a
     * worker that has just started is still requesting its first calls. */
    pthread_mutex_lock(&s->mu);
    w->armed = 1;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    for (;;) {
        grpc_event ev = grpc_completion_queue_next(w->cq, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL);
        if (ev.type == GRPC_QUEUE_SHUTDOWN)
            break;
        if (ev.type != GRPC_OP_COMPLETE)
            continue;
        uintptr_t tag = (uintptr_t)ev.tag;
        kvd_call *c = (kvd_call *)(tag & ~(uintptr_t)1);
        kvd_cpu_task_begin(); /* the CPU slots favour what has computed least */
        if (tag & 1)
            on_close(c);
        else
            on_event(c, ev.success);
    }
    return NULL;
}

/* ---- transport security --------------------------------------------------- */

int kvd_listen_is_loopback(const char *listen)
{
    if (strncmp(listen, "unix:", 5) == 0 || strncmp(listen, "unix-abstract:", 14) == 0)
        return 1;
    const char *a = listen;
    if (strncmp(a, "ipv4:", 5) == 0 || strncmp(a, "ipv6:", 5) == 0)
        a += 5;
    if (strncmp(a, "dns:", 4) == 0)
        a += 4;
    char host[256];
    const char *colon = strrchr(a, ':');
    size_t hl = colon ? (size_t)(colon - a) : strlen(a);
    if (hl >= 2 && a[0] == '[' && a[hl - 1] == ']') {
        a++;
        hl -= 2;
    }
    if (hl == 0 || hl >= sizeof host)
        return 0; /* ":50051" binds every interface */
    memcpy(host, a, hl);
    host[hl] = '\0';
    if (strcmp(host, "localhost") == 0)
        return 1;
    struct in_addr v4;
    struct in6_addr v6;
    if (inet_pton(AF_INET, host, &v4) == 1)
        return (ntohl(v4.s_addr) >> 24) == 127;
    if (inet_pton(AF_INET6, host, &v6) == 1)
        return IN6_IS_ADDR_LOOPBACK(&v6);
    return 0;
}

int kvd_server_check_security(const kvd_config *cfg, char *err, size_t errlen)
{
    int have_cert = cfg->tls_cert != NULL, have_key = cfg->tls_key != NULL;
    if (have_cert != have_key) {
        snprintf(err, errlen, "--tls-cert and --tls-key go together (%s given alone)",
                 have_cert ? "--tls-cert" : "--tls-key");
        return -1;
    }
    if (have_cert && cfg->insecure) {
        snprintf(err, errlen, "--insecure contradicts --tls-cert: choose one");
        return -1;
    }
    if (cfg->tls_client_ca && !have_cert) {
        snprintf(err, errlen, "--tls-client-ca needs --tls-cert and --tls-key");
        return -1;
    }
    if (!have_cert && !kvd_listen_is_loopback(cfg->listen) &&
        !(cfg->insecure && cfg->allow_insecure_remote)) {
        snprintf(err, errlen,
                 "refusing plaintext on %s, which is not a loopback address: give "
                 "--tls-cert and --tls-key, or --insecure --allow-insecure-remote",
                 cfg->listen);
        return -1;
    }
    return 0;
}

/* Read a whole PEM file into a NUL-terminated malloc'd string. */
static char *read_pem(const char *path, const char *what, char *err, size_t errlen)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        snprintf(err, errlen, "%s %s: %s", what, path, strerror(errno));
        return NULL;
    }
    size_t cap = 8192, len = 0;
    char *p = malloc(cap);
    while (p) {
        len += fread(p + len, 1, cap - 1 - len, f);
        if (len < cap - 1)
            break;
        char *np = cap < (64u << 20) ? realloc(p, cap * 2) : NULL;
        if (!np) {
            free(p);
            p = NULL;
            break;
        }
        p = np;
        cap *= 2;
    }
    int bad = ferror(f);
    fclose(f);
    if (!p || bad || len == 0) {
        snprintf(err, errlen, "%s %s: %s", what, path,
                 !p ? "too large or out of memory" : bad ? "read error" : "empty file");
        free(p);
        return NULL;
    }
    p[len] = '\0';
    return p;
}

static grpc_server_credentials *server_credentials(const kvd_config *cfg, char *err,
                                                   size_t errlen)
{
    if (!cfg->tls_cert)
        return grpc_insecure_server_credentials_create();
    char *cert = read_pem(cfg->tls_cert, "--tls-cert", err, errlen);
    char *key = cert ? read_pem(cfg->tls_key, "--tls-key", err, errlen) : NULL;
    char *ca = key && cfg->tls_client_ca
                   ? read_pem(cfg->tls_client_ca, "--tls-client-ca", err, errlen)
                   : NULL;
    grpc_server_credentials *creds = NULL;
    if (key && (ca || !cfg->tls_client_ca)) {
        grpc_ssl_pem_key_cert_pair pair = {key, cert};
        creds = grpc_ssl_server_credentials_create_ex(
            ca, &pair, 1,
            ca ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
               : GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE,
            NULL);
        if (!creds)
            snprintf(err, errlen, "TLS credentials from %s and %s were refused", cfg->tls_cert,
                     cfg->tls_key);
    }
    /* gRPC copied what it keeps; wipe the private key from our heap. */
    if (key)
        memset(key, 0, strlen(key));
    free(cert);
    free(key);
    free(ca);
    return creds;
}

/* ---- start / shutdown --------------------------------------------------- */

static void destroy_partial(kvd_server *s)
{
    if (s->server)
        grpc_server_destroy(s->server);
    for (size_t i = 0; i < s->nworkers; i++)
        if (s->workers[i].cq) {
            grpc_completion_queue_shutdown(s->workers[i].cq);
            while (grpc_completion_queue_next(s->workers[i].cq,
                                              gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL)
                       .type != GRPC_QUEUE_SHUTDOWN)
                ;
            grpc_completion_queue_destroy(s->workers[i].cq);
        }
    free(s->workers);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv);
    free(s);
}

int kvd_server_start(kvd_service *svc, kvd_server **out, int *port, char *err, size_t errlen)
{
    const kvd_config *cfg = svc->cfg;
    *out = NULL;
    kvd_server *s = calloc(1, sizeof *s);
    if (!s) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    s->svc = svc;
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    s->nworkers = (size_t)cfg->threads;
    s->workers = calloc(s->nworkers, sizeof *s->workers);
    if (!s->workers) {
        snprintf(err, errlen, "out of memory");
        destroy_partial(s);
        return -1;
    }

    /* Limits are set explicitly: the C core's defaults (4 MiB receive) are
     * not ours. SO_REUSEPORT is off so that a second server on the same port
     * fails to start instead of silently sharing it. */
    grpc_arg args[10];
    args[0].type = GRPC_ARG_INTEGER;
    args[0].key = GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH;
    args[0].value.integer = (int)cfg->max_message_bytes;
    args[1].type = GRPC_ARG_INTEGER;
    args[1].key = GRPC_ARG_MAX_SEND_MESSAGE_LENGTH;
    args[1].value.integer = (int)cfg->max_message_bytes;
    args[2].type = GRPC_ARG_INTEGER;
    args[2].key = GRPC_ARG_ALLOW_REUSEPORT;
    args[2].value.integer = 0;
    /* Concurrency and keepalive, so that idle or dead peers are noticed and
     * one client cannot open streams without bound. */
    /* A connection that has not finished its TLS handshake and sent its
     * HTTP/2 settings within handshake_timeout_ms is closed: idle sockets
     * cannot hold descriptors for long. */
    static const char *const int_keys[] = {
        GRPC_ARG_MAX_CONCURRENT_STREAMS,
        GRPC_ARG_KEEPALIVE_TIME_MS,
        GRPC_ARG_KEEPALIVE_TIMEOUT_MS,
        GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS,
        GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS,
        GRPC_ARG_HTTP2_MAX_PING_STRIKES,
        GRPC_ARG_SERVER_HANDSHAKE_TIMEOUT_MS,
    };
    const uint64_t int_vals[] = {
        cfg->max_concurrent_streams,         cfg->keepalive_time_ms,
        cfg->keepalive_timeout_ms,           cfg->keepalive_min_ping_interval_ms,
        (uint64_t)cfg->keepalive_permit_without_calls, 2, cfg->handshake_timeout_ms,
    };
    for (size_t i = 0; i < 7; i++) {
        args[3 + i].type = GRPC_ARG_INTEGER;
        args[3 + i].key = (char *)int_keys[i];
        args[3 + i].value.integer = int_vals[i] > INT32_MAX ? INT32_MAX : (int)int_vals[i];
    }
    grpc_channel_args chargs = {10, args};
    s->server = grpc_server_create(&chargs, NULL);

    for (size_t i = 0; i < s->nworkers; i++) {
        s->workers[i].srv = s;
        s->workers[i].cq = grpc_completion_queue_create_for_next(NULL);
        grpc_server_register_completion_queue(s->server, s->workers[i].cq, NULL);
    }
    grpc_server_credentials *creds = server_credentials(cfg, err, errlen);
    if (!creds) {
        destroy_partial(s);
        return -1;
    }
    *port = grpc_server_add_http2_port(s->server, cfg->listen, creds);
    grpc_server_credentials_release(creds);
    if (*port <= 0) {
        snprintf(err, errlen, "cannot listen on %s (address in use or not valid)", cfg->listen);
        destroy_partial(s);
        return -1;
    }
    grpc_server_start(s->server);
    for (size_t i = 0; i < s->nworkers; i++) {
        if (pthread_create(&s->workers[i].thread, NULL, worker_main, &s->workers[i]) != 0) {
            snprintf(err, errlen, "cannot start worker thread %zu", i);
            /* Workers already running stop through the normal shutdown. */
            atomic_store(&svc->serving, 0);
            kvd_server_shutdown(s, 0);
            return -1;
        }
        s->workers[i].started = 1;
    }
    *out = s;
    return 0;
}

void kvd_server_shutdown(kvd_server *s, uint64_t grace_ms)
{
    if (!s)
        return;
    atomic_store(&s->shutting_down, 1);

    /* Held streams (health Watch) would otherwise last the whole grace. */
    pthread_mutex_lock(&s->mu);
    while (s->held) {
        kvd_call *c = s->held;
        hold_remove(s, c);
        finish_held(c);
    }
    pthread_mutex_unlock(&s->mu);

    /* A SIGTERM right after start may find workers still requesting their
     * first calls; let them finish, then those calls count as live. */
    pthread_mutex_lock(&s->mu);
    for (size_t i = 0; i < s->nworkers; i++)
        while (s->workers[i].started && !s->workers[i].armed)
            pthread_cond_wait(&s->cv, &s->mu);
    pthread_mutex_unlock(&s->mu);

    grpc_completion_queue *scq = grpc_completion_queue_create_for_pluck(NULL);
    static int shutdown_tag;
    grpc_server_shutdown_and_notify(s->server, scq, &shutdown_tag);
    gpr_timespec deadline =
        gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC),
                     gpr_time_from_millis((int64_t)grace_ms, GPR_TIMESPAN));
    grpc_event ev = grpc_completion_queue_pluck(scq, &shutdown_tag, deadline, NULL);
    if (ev.type == GRPC_QUEUE_TIMEOUT) {
        KVD_LOG(KVD_LOG_WARN, "grace period over: cancelling calls still in flight",
                "grace_ms=%" PRIu64, grace_ms);
        grpc_server_cancel_all_calls(s->server);
        grpc_completion_queue_pluck(scq, &shutdown_tag, gpr_inf_future(GPR_CLOCK_MONOTONIC),
                                    NULL);
    }
    grpc_completion_queue_shutdown(scq);
    grpc_completion_queue_destroy(scq);

    /* Every call struct must be gone before the queues stop: a worker still
     * handling one may start another batch on it. */
    pthread_mutex_lock(&s->mu);
    while (s->live > 0) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_sec += 1;
        if (pthread_cond_timedwait(&s->cv, &s->mu, &ts) != 0 && s->live > 0) {
            pthread_mutex_unlock(&s->mu);
            grpc_server_cancel_all_calls(s->server);
            pthread_mutex_lock(&s->mu);
        }
    }
    pthread_mutex_unlock(&s->mu);

    grpc_server_destroy(s->server);
    s->server = NULL;
    for (size_t i = 0; i < s->nworkers; i++) {
        grpc_completion_queue_shutdown(s->workers[i].cq);
        if (s->workers[i].started)
            pthread_join(s->workers[i].thread, NULL);
        else
            while (grpc_completion_queue_next(s->workers[i].cq,
                                              gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL)
                       .type != GRPC_QUEUE_SHUTDOWN)
                ;
        grpc_completion_queue_destroy(s->workers[i].cq);
        s->workers[i].cq = NULL;
    }
    free(s->workers);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv);
    free(s);
}

int kvd_ctx_expired(const kvd_req_ctx *ctx)
{
    if (ctx->deadline.tv_sec == 0 && ctx->deadline.tv_nsec == 0)
        return 0;
    gpr_timespec now = gpr_now(ctx->deadline.clock_type);
    return gpr_time_cmp(now, ctx->deadline) >= 0;
}
