/*
 * libkvdepot: connection, errors, the per-call machinery shared by every RPC,
 * and the unary RPCs. Streaming RPCs (Append, Read) are in stream.c.
 */
#include "internal.h"

#include "kvdepot/status.h"
#include "kvdepot/v1/kvdepot.pb-c.h"
#include "grpc/health/v1/health.pb-c.h"

#include <grpc/byte_buffer.h>
#include <grpc/byte_buffer_reader.h>
#include <grpc/grpc_security.h>
#include <grpc/slice.h>
#include <grpc/support/time.h>

#include <limits.h>
#include <stdarg.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

/* The public header cannot include status.h, so it repeats the codes; keep
 * them in lockstep with the one table the server uses. */
_Static_assert(KVDEPOT_ECANCELLED == (int)KVD_CANCELLED, "CANCELLED");
_Static_assert(KVDEPOT_EUNKNOWN == (int)KVD_EUNKNOWN, "UNKNOWN");
_Static_assert(KVDEPOT_EINVAL == (int)KVD_EINVAL, "INVALID_ARGUMENT");
_Static_assert(KVDEPOT_ETIMEDOUT == (int)KVD_ETIMEDOUT, "DEADLINE_EXCEEDED");
_Static_assert(KVDEPOT_ENOTFOUND == (int)KVD_ENOTFOUND, "NOT_FOUND");
_Static_assert(KVDEPOT_EEXIST == (int)KVD_EEXIST, "ALREADY_EXISTS");
_Static_assert(KVDEPOT_EPERM == (int)KVD_EPERM, "PERMISSION_DENIED");
_Static_assert(KVDEPOT_ENOMEM == (int)KVD_ENOMEM, "RESOURCE_EXHAUSTED");
_Static_assert(KVDEPOT_EPRECOND == (int)KVD_EPRECOND, "FAILED_PRECONDITION");
_Static_assert(KVDEPOT_EABORTED == (int)KVD_EABORTED, "ABORTED");
_Static_assert(KVDEPOT_ERANGE == (int)KVD_ERANGE, "OUT_OF_RANGE");
_Static_assert(KVDEPOT_EUNSUPP == (int)KVD_EUNSUPP, "UNIMPLEMENTED");
_Static_assert(KVDEPOT_EINTERNAL == (int)KVD_EINTERNAL, "INTERNAL");
_Static_assert(KVDEPOT_EUNAVAIL == (int)KVD_EUNAVAIL, "UNAVAILABLE");
_Static_assert(KVDEPOT_ECORRUPT == (int)KVD_ECORRUPT, "DATA_LOSS");
_Static_assert(KVDEPOT_EAUTH == (int)KVD_EAUTH, "UNAUTHENTICATED");
/* The wire dtype numbers are the public ones. */
_Static_assert(KVDEPOT_DTYPE_F16 == (int)KVDEPOT__V1__DTYPE__DTYPE_F16, "f16");
_Static_assert(KVDEPOT_DTYPE_BF16 == (int)KVDEPOT__V1__DTYPE__DTYPE_BF16, "bf16");
_Static_assert(KVDEPOT_DTYPE_F32 == (int)KVDEPOT__V1__DTYPE__DTYPE_F32, "f32");

static const char *const method_paths[KVDEPOT__METHOD_COUNT] = {
    [KVDEPOT__PUT_MODEL] = "/kvdepot.v1.KVDepot/PutModel",
    [KVDEPOT__GET_MODEL] = "/kvdepot.v1.KVDepot/GetModel",
    [KVDEPOT__LIST_MODELS] = "/kvdepot.v1.KVDepot/ListModels",
    [KVDEPOT__DELETE_MODEL] = "/kvdepot.v1.KVDepot/DeleteModel",
    [KVDEPOT__CREATE_SEQUENCE] = "/kvdepot.v1.KVDepot/CreateSequence",
    [KVDEPOT__APPEND] = "/kvdepot.v1.KVDepot/Append",
    [KVDEPOT__READ] = "/kvdepot.v1.KVDepot/Read",
    [KVDEPOT__LOOKUP] = "/kvdepot.v1.KVDepot/Lookup",
    [KVDEPOT__STAT_SEQUENCE] = "/kvdepot.v1.KVDepot/StatSequence",
    [KVDEPOT__LIST_SEQUENCES] = "/kvdepot.v1.KVDepot/ListSequences",
    [KVDEPOT__DELETE_SEQUENCE] = "/kvdepot.v1.KVDepot/DeleteSequence",
    [KVDEPOT__HEALTH_CHECK] = "/grpc.health.v1.Health/Check",
    [KVDEPOT__EVICT_SEQUENCE] = "/kvdepot.v1.KVDepot/EvictSequence",
    [KVDEPOT__STATS] = "/kvdepot.v1.KVDepot/Stats",
    [KVDEPOT__BACKUP] = "/kvdepot.v1.KVDepot/Backup",
};

/* ------------------------------------------------------------------------ */
/* Errors and logging                                                        */
/* ------------------------------------------------------------------------ */

const char *kvdepot_version(void)
{
    return KVDEPOT_LIB_VERSION;
}

/* Per thread, so that concurrent calls on one client keep their own message. */
static _Thread_local char tls_errmsg[512];

const char *kvdepot_errmsg(const kvdepot_client *client)
{
    (void)client;
    return tls_errmsg;
}

const char *kvdepot_strerror(int status) { return kvd_strerror(status); }

const char *kvdepot_status_name(int status) { return kvd_status_name(status); }

void kvdepot_free(void *ptr) { free(ptr); }

void kvdepot__clear_error(void) { tls_errmsg[0] = '\0'; }

void kvdepot__log(kvdepot_client *c, kvdepot_log_level level, const char *fmt, ...)
{
    if (!c || !c->log || level > c->log_level)
        return;
    char buf[640];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    c->log(c->log_user, level, buf);
}

int kvdepot__fail(kvdepot_client *c, int code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(tls_errmsg, sizeof tls_errmsg, fmt, ap);
    va_end(ap);
    kvdepot__log(c, KVDEPOT_LOG_DEBUG, "%s: %s", kvd_status_name(code), tls_errmsg);
    return code;
}

/* ------------------------------------------------------------------------ */
/* Element types                                                             */
/* ------------------------------------------------------------------------ */

size_t kvdepot_dtype_size(kvdepot_dtype dtype)
{
    switch (dtype) {
    case KVDEPOT_DTYPE_F16:
    case KVDEPOT_DTYPE_BF16:
        return 2;
    case KVDEPOT_DTYPE_F32:
        return 4;
    default:
        return 0;
    }
}

const char *kvdepot_dtype_name(kvdepot_dtype dtype)
{
    switch (dtype) {
    case KVDEPOT_DTYPE_F16:
        return "f16";
    case KVDEPOT_DTYPE_BF16:
        return "bf16";
    case KVDEPOT_DTYPE_F32:
        return "f32";
    default:
        return "unspecified";
    }
}

int kvdepot_dtype_parse(const char *name, kvdepot_dtype *out)
{
    static const struct {
        const char *name;
        kvdepot_dtype dtype;
    } names[] = {
        {"f16", KVDEPOT_DTYPE_F16},       {"float16", KVDEPOT_DTYPE_F16},
        {"fp16", KVDEPOT_DTYPE_F16},      {"bf16", KVDEPOT_DTYPE_BF16},
        {"bfloat16", KVDEPOT_DTYPE_BF16}, {"f32", KVDEPOT_DTYPE_F32},
        {"float32", KVDEPOT_DTYPE_F32},   {"fp32", KVDEPOT_DTYPE_F32},
    };
    kvdepot__clear_error();
    for (size_t i = 0; name && i < sizeof names / sizeof names[0]; i++) {
        if (strcmp(name, names[i].name) == 0) {
            if (out)
                *out = names[i].dtype;
            return KVDEPOT_OK;
        }
    }
    return kvdepot__fail(NULL, KVDEPOT_EINVAL, "unknown dtype \"%s\" (want f16, bf16 or f32)",
                         name ? name : "");
}

size_t kvdepot_kv_bytes(const kvdepot_model *m, uint32_t num_layers, uint64_t num_tokens)
{
    if (!m)
        return 0;
    uint64_t f[5] = {num_layers, num_tokens, m->num_kv_heads, m->head_dim,
                     kvdepot_dtype_size(m->dtype)};
    uint64_t n = 1;
    for (int i = 0; i < 5; i++) {
        if (f[i] != 0 && n > SIZE_MAX / f[i])
            return 0;
        n *= f[i];
    }
    return (size_t)n;
}

/* ------------------------------------------------------------------------ */
/* Connecting                                                                */
/* ------------------------------------------------------------------------ */

void kvdepot_options_init(kvdepot_options *opt)
{
    if (!opt)
        return;
    memset(opt, 0, sizeof *opt);
    opt->address = "127.0.0.1:50051";
    opt->deadline_ms = 60000;
    opt->max_message_bytes = 8u << 20;
    opt->chunk_bytes = 1u << 20;
    opt->log_level = KVDEPOT_LOG_WARN;
    opt->connect_timeout_ms = 1000;
    opt->shard_retries = 1;
    opt->shard_backoff_ms = 100;
    opt->resolve_interval_ms = 30000;
}

/* Read a whole PEM file; NULL with the error set when it cannot be read. */
static char *read_pem(const char *path, const char *what)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        kvdepot__fail(NULL, KVDEPOT_EINVAL, "kvdepot_connect: %s %s: %s", what, path,
                      strerror(errno));
        return NULL;
    }
    size_t cap = 8192, len = 0;
    char *p = malloc(cap);
    while (p) {
        len += fread(p + len, 1, cap - 1 - len, f);
        if (len < cap - 1)
            break;
        char *np = cap < (16u << 20) ? realloc(p, cap * 2) : NULL;
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
        free(p);
        kvdepot__fail(NULL, KVDEPOT_EINVAL, "kvdepot_connect: %s %s: %s", what, path,
                      bad ? "read error" : len == 0 && p ? "empty file" : "too large");
        return NULL;
    }
    p[len] = '\0';
    return p;
}

/* Plaintext, or TLS with the roots, client certificate and key the options
 * name. Returns KVDEPOT_OK with *out set, or an error with the message set. */
static int channel_credentials(const kvdepot_options *opt, grpc_channel_credentials **out)
{
    *out = NULL;
    int tls = opt->tls || opt->tls_ca_file || opt->tls_cert_file || opt->tls_key_file;
    if (!tls) {
        *out = grpc_insecure_credentials_create();
        return KVDEPOT_OK;
    }
    if (!opt->tls_cert_file != !opt->tls_key_file)
        return kvdepot__fail(NULL, KVDEPOT_EINVAL,
                             "kvdepot_connect: tls_cert_file and tls_key_file go together");
    char *ca = NULL, *cert = NULL, *key = NULL;
    int rc = KVDEPOT_OK;
    if (opt->tls_ca_file && !(ca = read_pem(opt->tls_ca_file, "tls_ca_file")))
        rc = KVDEPOT_EINVAL;
    if (!rc && opt->tls_cert_file &&
        (!(cert = read_pem(opt->tls_cert_file, "tls_cert_file")) ||
         !(key = read_pem(opt->tls_key_file, "tls_key_file"))))
        rc = KVDEPOT_EINVAL;
    if (!rc) {
        grpc_ssl_pem_key_cert_pair pair = {key, cert};
        *out = grpc_ssl_credentials_create_ex(ca, cert ? &pair : NULL, NULL, NULL);
        if (!*out)
            rc = kvdepot__fail(NULL, KVDEPOT_EINVAL,
                               "kvdepot_connect: gRPC refused the TLS files");
    }
    if (key)
        memset(key, 0, strlen(key));
    free(ca);
    free(cert);
    free(key);
    return rc;
}

static int set_token(kvdepot_client *c, const char *token)
{
    size_t n = strlen(token);
    if (!(c->auth_value = malloc(n + 8)))
        return -1;
    memcpy(c->auth_value, "Bearer ", 7);
    memcpy(c->auth_value + 7, token, n + 1);
    c->auth_md.key = grpc_slice_from_static_string("authorization");
    c->auth_md.value = grpc_slice_from_static_string(c->auth_value);
    c->n_md = 1;
    return 0;
}

void kvdepot__initial_md(const kvdepot_client *c, grpc_op *op)
{
    if (c->n_md) {
        op->data.send_initial_metadata.count = c->n_md;
        op->data.send_initial_metadata.metadata = (grpc_metadata *)&c->auth_md;
    }
}

int kvdepot_connect(const kvdepot_options *opt_in, kvdepot_client **out)
{
    kvdepot__clear_error();
    if (!out)
        return kvdepot__fail(NULL, KVDEPOT_EINVAL, "kvdepot_connect: out is NULL");
    *out = NULL;
    kvdepot_options opt;
    if (opt_in)
        opt = *opt_in;
    else
        kvdepot_options_init(&opt);
    if (!opt.address || !opt.address[0])
        return kvdepot__fail(NULL, KVDEPOT_EINVAL, "kvdepot_connect: no address");
    if (opt.chunk_bytes < 4096 || opt.chunk_bytes > (4u << 20))
        return kvdepot__fail(NULL, KVDEPOT_EINVAL,
                             "kvdepot_connect: chunk_bytes %zu not in 4 KiB..4 MiB",
                             opt.chunk_bytes);
    /* Room for the Append header (token ids) beside a full chunk. */
    if (opt.max_message_bytes < opt.chunk_bytes + (64u << 10) ||
        opt.max_message_bytes > (size_t)INT_MAX)
        return kvdepot__fail(NULL, KVDEPOT_EINVAL,
                             "kvdepot_connect: max_message_bytes %zu must be in "
                             "chunk_bytes + 64 KiB..2 GiB",
                             opt.max_message_bytes);

    /* A list of endpoints, or shards:NAME, is served by shard.c. */
    if (kvdepot__cluster_wanted(opt.address))
        return kvdepot__cluster_connect(&opt, out);

    kvdepot_client *c = calloc(1, sizeof *c);
    if (!c || !(c->address = strdup(opt.address))) {
        free(c);
        return kvdepot__fail(NULL, KVDEPOT_ENOMEM, "kvdepot_connect: out of memory");
    }
    c->deadline_ms = opt.deadline_ms;
    c->max_message_bytes = opt.max_message_bytes;
    c->chunk_bytes = opt.chunk_bytes;
    c->wait_for_ready = opt.wait_for_ready;
    c->log = opt.log;
    c->log_user = opt.log_user;
    c->log_level = opt.log_level;

    grpc_init();
    grpc_arg args[] = {
        {.type = GRPC_ARG_INTEGER,
         .key = (char *)GRPC_ARG_MAX_SEND_MESSAGE_LENGTH,
         .value.integer = (int)c->max_message_bytes},
        {.type = GRPC_ARG_INTEGER,
         .key = (char *)GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH,
         .value.integer = (int)c->max_message_bytes},
        /* Each client gets its own connection instead of sharing one with
         * every other channel to the same target in the process. */
        {.type = GRPC_ARG_INTEGER,
         .key = (char *)GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL,
         .value.integer = 1},
        /* A restarted server should be found again quickly. Not the MIN
         * backoff: gRPC also takes it as the time a connection attempt may
         * last, and a TLS handshake on a busy machine needs more than the
         * 100 ms that would allow. */
        {.type = GRPC_ARG_INTEGER,
         .key = (char *)GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS,
         .value.integer = 100},
        {.type = GRPC_ARG_INTEGER,
         .key = (char *)GRPC_ARG_MAX_RECONNECT_BACKOFF_MS,
         .value.integer = 2000},
    };
    grpc_arg all_args[sizeof args / sizeof args[0] + 1];
    memcpy(all_args, args, sizeof args);
    size_t nargs = sizeof args / sizeof args[0];
    if (opt.tls_server_name && opt.tls_server_name[0])
        all_args[nargs++] = (grpc_arg){.type = GRPC_ARG_STRING,
                                       .key = (char *)GRPC_SSL_TARGET_NAME_OVERRIDE_ARG,
                                       .value.string = (char *)opt.tls_server_name};
    grpc_channel_args cargs = {.num_args = nargs, .args = all_args};
    grpc_channel_credentials *creds = NULL;
    int crc = channel_credentials(&opt, &creds);
    if (crc == KVDEPOT_OK && opt.token && opt.token[0] && set_token(c, opt.token) != 0)
        crc = kvdepot__fail(NULL, KVDEPOT_ENOMEM, "kvdepot_connect: out of memory");
    if (crc != KVDEPOT_OK) {
        if (creds)
            grpc_channel_credentials_release(creds);
        free(c->auth_value);
        free(c->address);
        free(c);
        grpc_shutdown();
        return crc;
    }
    c->channel = grpc_channel_create(c->address, creds, &cargs);
    grpc_channel_credentials_release(creds);
    if (!c->channel) {
        free(c->auth_value);
        free(c->address);
        free(c);
        grpc_shutdown();
        return kvdepot__fail(NULL, KVDEPOT_EINTERNAL, "kvdepot_connect: cannot create a channel to %s",
                             opt.address);
    }
    for (int i = 0; i < KVDEPOT__METHOD_COUNT; i++)
        c->methods[i] = grpc_channel_register_call(c->channel, method_paths[i], NULL, NULL);
    kvdepot__log(c, KVDEPOT_LOG_INFO, "kvdepot: client for %s", c->address);
    *out = c;
    return KVDEPOT_OK;
}

void kvdepot_set_progress(kvdepot_client *c, kvdepot_progress_fn fn, void *user)
{
    if (!c)
        return;
    c->progress = fn;
    c->progress_user = fn ? user : NULL;
}

void kvdepot_close(kvdepot_client *c)
{
    if (!c)
        return;
    if (c->cluster) {
        kvdepot__cluster_close(c);
        return;
    }
    grpc_channel_destroy(c->channel);
    free(c->auth_value);
    free(c->address);
    free(c);
    grpc_shutdown();
}

/* ------------------------------------------------------------------------ */
/* Calls                                                                     */
/* ------------------------------------------------------------------------ */

static gpr_timespec call_deadline(const kvdepot_client *c)
{
    if (!c->deadline_ms)
        return gpr_inf_future(GPR_CLOCK_MONOTONIC);
    return gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC),
                        gpr_time_from_millis((int64_t)c->deadline_ms, GPR_TIMESPAN));
}

int kvdepot__call_start(kvdepot_client *c, int method, const char *path, kvdepot__call *k)
{
    memset(k, 0, sizeof *k);
    k->client = c;
    k->name = method >= 0 ? method_paths[method] : path;
    k->status = GRPC_STATUS_UNKNOWN;
    k->details = grpc_empty_slice();
    grpc_metadata_array_init(&k->initial_md);
    grpc_metadata_array_init(&k->trailing_md);
    /* A client over several servers has no channel of its own: an RPC
     * wrapper that does not forward to shard.c must fail, not crash. */
    if (c->cluster)
        return kvdepot__fail(c, KVDEPOT_EUNSUPP, "%s: not available on a client over several servers",
                             k->name);
    k->cq = grpc_completion_queue_create_for_pluck(NULL);
    if (!k->cq)
        return kvdepot__fail(c, KVDEPOT_ENOMEM, "%s: cannot create a completion queue", k->name);
    gpr_timespec dl = call_deadline(c);
    if (method >= 0) {
        k->call = grpc_channel_create_registered_call(c->channel, NULL, GRPC_PROPAGATE_DEFAULTS,
                                                      k->cq, c->methods[method], dl, NULL);
    } else {
        grpc_slice m = grpc_slice_from_copied_string(path);
        k->call = grpc_channel_create_call(c->channel, NULL, GRPC_PROPAGATE_DEFAULTS, k->cq, m,
                                           NULL, dl, NULL);
        grpc_slice_unref(m);
    }
    if (!k->call)
        return kvdepot__fail(c, KVDEPOT_EINTERNAL, "%s: cannot create a call", k->name);
    return KVDEPOT_OK;
}

int kvdepot__call_start_batch(kvdepot__call *k, const grpc_op *ops, size_t nops, void *tag)
{
    grpc_call_error e = grpc_call_start_batch(k->call, ops, nops, tag, NULL);
    if (e != GRPC_CALL_OK) {
        kvdepot__log(k->client, KVDEPOT_LOG_ERROR, "%s: grpc_call_start_batch: %s", k->name,
                     grpc_call_error_to_string(e));
        return -1;
    }
    return 0;
}

int kvdepot__call_wait(kvdepot__call *k, void *tag)
{
    grpc_event ev = grpc_completion_queue_pluck(k->cq, tag, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
    return ev.type == GRPC_OP_COMPLETE ? ev.success : 0;
}

int kvdepot__call_batch(kvdepot__call *k, const grpc_op *ops, size_t nops, void *tag)
{
    if (kvdepot__call_start_batch(k, ops, nops, tag) != 0)
        return -1;
    return kvdepot__call_wait(k, tag);
}

static uint32_t md_flags(const kvdepot_client *c)
{
    return c->wait_for_ready ? GRPC_INITIAL_METADATA_WAIT_FOR_READY : 0;
}

int kvdepot__call_send_request(kvdepot__call *k, grpc_byte_buffer *send, void *tag)
{
    if (!send)
        return -1;
    grpc_op ops[4];
    memset(ops, 0, sizeof ops);
    ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
    ops[0].flags = md_flags(k->client);
    kvdepot__initial_md(k->client, &ops[0]);
    ops[1].op = GRPC_OP_SEND_MESSAGE;
    ops[1].data.send_message.send_message = send;
    ops[2].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
    ops[3].op = GRPC_OP_RECV_INITIAL_METADATA;
    ops[3].data.recv_initial_metadata.recv_initial_metadata = &k->initial_md;
    return kvdepot__call_batch(k, ops, 4, tag);
}

grpc_byte_buffer *kvdepot__call_recv(kvdepot__call *k, void *tag)
{
    grpc_byte_buffer *bb = NULL;
    grpc_op op;
    memset(&op, 0, sizeof op);
    op.op = GRPC_OP_RECV_MESSAGE;
    op.data.recv_message.recv_message = &bb;
    if (kvdepot__call_batch(k, &op, 1, tag) != 1 && bb) {
        grpc_byte_buffer_destroy(bb);
        bb = NULL;
    }
    return bb;
}

int kvdepot__call_result(kvdepot__call *k)
{
    if (k->status == GRPC_STATUS_OK)
        return KVDEPOT_OK;
    int code = (int)k->status;
    int rc = (code > 0 && code <= 16) ? -code : KVDEPOT_EUNKNOWN;
    size_t len = GRPC_SLICE_LENGTH(k->details);
    if (len)
        return kvdepot__fail(k->client, rc, "%.*s", (int)len,
                             (const char *)GRPC_SLICE_START_PTR(k->details));
    return kvdepot__fail(k->client, rc, "%s: %s", k->name, kvd_strerror(rc));
}

void kvdepot__call_end(kvdepot__call *k)
{
    if (k->call)
        grpc_call_unref(k->call);
    k->call = NULL;
    if (k->cq) {
        grpc_completion_queue_shutdown(k->cq);
        /* Every batch was waited for, so this only sees the shutdown. */
        for (;;) {
            grpc_event ev = grpc_completion_queue_pluck(k->cq, NULL,
                                                        gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
            if (ev.type == GRPC_QUEUE_SHUTDOWN)
                break;
        }
        grpc_completion_queue_destroy(k->cq);
        k->cq = NULL;
    }
    grpc_metadata_array_destroy(&k->initial_md);
    grpc_metadata_array_destroy(&k->trailing_md);
    grpc_slice_unref(k->details);
    k->details = grpc_empty_slice();
}

grpc_byte_buffer *kvdepot__pack(const ProtobufCMessage *msg)
{
    size_t n = protobuf_c_message_get_packed_size(msg);
    grpc_slice s = grpc_slice_malloc(n);
    protobuf_c_message_pack(msg, GRPC_SLICE_START_PTR(s));
    grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(&s, 1);
    grpc_slice_unref(s);
    return bb;
}

/* Contiguous copy of a received message; the caller unrefs the slice. */
static grpc_slice byte_buffer_flatten(grpc_byte_buffer *bb)
{
    grpc_byte_buffer_reader r;
    if (!grpc_byte_buffer_reader_init(&r, bb))
        return grpc_empty_slice();
    grpc_slice s = grpc_byte_buffer_reader_readall(&r);
    grpc_byte_buffer_reader_destroy(&r);
    return s;
}

/*
 * One unary RPC: send req, wait for the status, unpack the response with
 * rdesc. On success *resp is the unpacked response (free with
 * protobuf_c_message_free_unpacked); on failure it is NULL and the thread's
 * error message is set.
 */
static int unary(kvdepot_client *c, int method, const ProtobufCMessage *req,
                 const ProtobufCMessageDescriptor *rdesc, ProtobufCMessage **resp)
{
    *resp = NULL;
    kvdepot__call k;
    int rc = kvdepot__call_start(c, method, NULL, &k);
    if (rc) {
        kvdepot__call_end(&k);
        return rc;
    }
    grpc_byte_buffer *send = kvdepot__pack(req);
    grpc_byte_buffer *recv = NULL;
    grpc_op ops[6];
    memset(ops, 0, sizeof ops);
    ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
    ops[0].flags = md_flags(c);
    kvdepot__initial_md(c, &ops[0]);
    ops[1].op = GRPC_OP_SEND_MESSAGE;
    ops[1].data.send_message.send_message = send;
    ops[2].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
    ops[3].op = GRPC_OP_RECV_INITIAL_METADATA;
    ops[3].data.recv_initial_metadata.recv_initial_metadata = &k.initial_md;
    ops[4].op = GRPC_OP_RECV_MESSAGE;
    ops[4].data.recv_message.recv_message = &recv;
    ops[5].op = GRPC_OP_RECV_STATUS_ON_CLIENT;
    ops[5].data.recv_status_on_client.trailing_metadata = &k.trailing_md;
    ops[5].data.recv_status_on_client.status = &k.status;
    ops[5].data.recv_status_on_client.status_details = &k.details;
    if (kvdepot__call_batch(&k, ops, 6, &k) < 0)
        rc = kvdepot__fail(c, KVDEPOT_EINTERNAL, "%s: gRPC refused the call", k.name);
    else
        rc = kvdepot__call_result(&k);
    if (rc == KVDEPOT_OK) {
        if (!recv) {
            rc = kvdepot__fail(c, KVDEPOT_EINTERNAL, "%s: server sent no response", k.name);
        } else {
            grpc_slice s = byte_buffer_flatten(recv);
            *resp = protobuf_c_message_unpack(rdesc, NULL, GRPC_SLICE_LENGTH(s),
                                              GRPC_SLICE_START_PTR(s));
            grpc_slice_unref(s);
            if (!*resp)
                rc = kvdepot__fail(c, KVDEPOT_EINTERNAL, "%s: malformed response", k.name);
        }
    }
    grpc_byte_buffer_destroy(send);
    if (recv)
        grpc_byte_buffer_destroy(recv);
    kvdepot__call_end(&k);
    kvdepot__log(c, KVDEPOT_LOG_DEBUG, "%s: %s", k.name, kvd_status_name(rc));
    return rc;
}

#define UNARY(c, m, req, type, resp) \
    unary((c), (m), &(req)->base, &type##__descriptor, (ProtobufCMessage **)(resp))

/* ------------------------------------------------------------------------ */
/* Health                                                                    */
/* ------------------------------------------------------------------------ */

int kvdepot_health_check(kvdepot_client *c, const char *service, kvdepot_serving *out)
{
    if (c && c->cluster)
        return kvdepot__cluster_health_check(c, service, out);
    kvdepot__clear_error();
    if (out)
        *out = KVDEPOT_SERVING_UNKNOWN;
    if (!c)
        return kvdepot__fail(NULL, KVDEPOT_EINVAL, "health check: client is NULL");
    Grpc__Health__V1__HealthCheckRequest req = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
    req.service = (char *)(service ? service : "");
    Grpc__Health__V1__HealthCheckResponse *resp;
    int rc = UNARY(c, KVDEPOT__HEALTH_CHECK, &req, grpc__health__v1__health_check_response, &resp);
    if (rc)
        return rc;
    if (out)
        *out = (kvdepot_serving)resp->status;
    protobuf_c_message_free_unpacked(&resp->base, NULL);
    return KVDEPOT_OK;
}

/* ------------------------------------------------------------------------ */
/* Models                                                                    */
/* ------------------------------------------------------------------------ */

static void copy_str(char *dst, size_t cap, const char *src)
{
    snprintf(dst, cap, "%s", src ? src : "");
}

static void model_from_pb(const Kvdepot__V1__Model *pb, kvdepot_model *out)
{
    memset(out, 0, sizeof *out);
    if (!pb)
        return;
    copy_str(out->name, sizeof out->name, pb->name);
    copy_str(out->revision, sizeof out->revision, pb->revision);
    out->num_layers = pb->num_layers;
    out->num_kv_heads = pb->num_kv_heads;
    out->num_q_heads = pb->num_q_heads;
    out->head_dim = pb->head_dim;
    out->hidden_size = pb->hidden_size;
    out->dtype = (kvdepot_dtype)pb->dtype;
    out->created_unix_ms = pb->created_unix_ms;
}

int kvdepot_model_put(kvdepot_client *c, const kvdepot_model *m, int replace, kvdepot_model *out,
                      int *created)
{
    /* out may be the model itself: read it before out is cleared. */
    kvdepot_model in;
    if (m) {
        in = *m;
        m = &in;
    }
    if (c && c->cluster)
        return kvdepot__cluster_model_put(c, m, replace, out, created);
    kvdepot__clear_error();
    if (out)
        memset(out, 0, sizeof *out);
    if (created)
        *created = 0;
    if (!c || !m)
        return kvdepot__fail(c, KVDEPOT_EINVAL, "model put: NULL argument");
    /* Copies bound the strings even if the caller did not terminate them. */
    char name[KVDEPOT_NAME_MAX + 1], rev[KVDEPOT_NAME_MAX + 1];
    snprintf(name, sizeof name, "%.*s", KVDEPOT_NAME_MAX, m->name);
    snprintf(rev, sizeof rev, "%.*s", KVDEPOT_NAME_MAX, m->revision);
    Kvdepot__V1__Model pm = KVDEPOT__V1__MODEL__INIT;
    pm.name = name;
    pm.revision = rev;
    pm.num_layers = m->num_layers;
    pm.num_kv_heads = m->num_kv_heads;
    pm.num_q_heads = m->num_q_heads;
    pm.head_dim = m->head_dim;
    pm.hidden_size = m->hidden_size;
    pm.dtype = (Kvdepot__V1__DType)m->dtype;
    Kvdepot__V1__PutModelRequest req = KVDEPOT__V1__PUT_MODEL_REQUEST__INIT;
    req.model = &pm;
    req.replace = replace != 0;
    Kvdepot__V1__PutModelResponse *resp;
    int rc = UNARY(c, KVDEPOT__PUT_MODEL, &req, kvdepot__v1__put_model_response, &resp);
    if (rc)
        return rc;
    if (out)
        model_from_pb(resp->model, out);
    if (created)
        *created = resp->created != 0;
    protobuf_c_message_free_unpacked(&resp->base, NULL);
    return KVDEPOT_OK;
}

int kvdepot_model_get(kvdepot_client *c, const char *name, kvdepot_model *out)
{
    if (c && c->cluster)
        return kvdepot__cluster_model_get(c, name, out);
    kvdepot__clear_error();
    if (out)
        memset(out, 0, sizeof *out);
    if (!c || !name)
        return kvdepot__fail(c, KVDEPOT_EINVAL, "model get: NULL argument");
    Kvdepot__V1__GetModelRequest req = KVDEPOT__V1__GET_MODEL_REQUEST__INIT;
    req.name = (char *)name;
    Kvdepot__V1__GetModelResponse *resp;
    int rc = UNARY(c, KVDEPOT__GET_MODEL, &req, kvdepot__v1__get_model_response, &resp);
    if (rc)
        return rc;
    if (out)
        model_from_pb(resp->model, out);
    protobuf_c_message_free_unpacked(&resp->base, NULL);
    return KVDEPOT_OK;
}

int kvdepot_model_list(kvdepot_client *c, kvdepot_model **out, size_t *count)
{
    if (c && c->cluster)
        return kvdepot__cluster_model_list(c, out, count);
    kvdepot__clear_error();
    if (out)
        *out = NULL;
    if (count)
        *count = 0;
    if (!c || !out || !count)
        return kvdepot__fail(c, KVDEPOT_EINVAL, "model list: NULL argument");
    Kvdepot__V1__ListModelsRequest req = KVDEPOT__V1__LIST_MODELS_REQUEST__INIT;
    Kvdepot__V1__ListModelsResponse *resp;
    int rc = UNARY(c, KVDEPOT__LIST_MODELS, &req, kvdepot__v1__list_models_response, &resp);
    if (rc)
        return rc;
    if (resp->n_models) {
        kvdepot_model *list = calloc(resp->n_models, sizeof *list);
        if (!list) {
            protobuf_c_message_free_unpacked(&resp->base, NULL);
            return kvdepot__fail(c, KVDEPOT_ENOMEM, "model list: out of memory");
        }
        for (size_t i = 0; i < resp->n_models; i++)
            model_from_pb(resp->models[i], &list[i]);
        *out = list;
        *count = resp->n_models;
    }
    protobuf_c_message_free_unpacked(&resp->base, NULL);
    return KVDEPOT_OK;
}

int kvdepot_model_delete(kvdepot_client *c, const char *name, int force, uint64_t *deleted)
{
    if (c && c->cluster)
        return kvdepot__cluster_model_delete(c, name, force, deleted);
    kvdepot__clear_error();
    if (deleted)
        *deleted = 0;
    if (!c || !name)
        return kvdepot__fail(c, KVDEPOT_EINVAL, "model delete: NULL argument");
    Kvdepot__V1__DeleteModelRequest req = KVDEPOT__V1__DELETE_MODEL_REQUEST__INIT;
    req.name = (char *)name;
    req.force = force != 0;
    Kvdepot__V1__DeleteModelResponse *resp;
    int rc = UNARY(c, KVDEPOT__DELETE_MODEL, &req, kvdepot__v1__delete_model_response, &resp);
    if (rc)
        return rc;
    if (deleted)
        *deleted = resp->deleted_sequences;
    protobuf_c_message_free_unpacked(&resp->base, NULL);
    return KVDEPOT_OK;
}

/* ------------------------------------------------------------------------ */
/* Sequences                                                                 */
/* ------------------------------------------------------------------------ */

void kvdepot_sequence_info_clear(kvdepot_sequence_info *info)
{
    if (!info)
        return;
    free(info->layer_tokens);
    free(info->block_hashes);
    free((uint32_t *)info->codecs.k.svd_widths);
    free((uint32_t *)info->codecs.v.svd_widths);
    memset(info, 0, sizeof *info);
}

/* One side of SequenceCodecs as the server reports it; 0 or -1 (memory). */
int kvdepot__spec_from_pb(const void *pb_spec, kvdepot_codec_spec *out)
{
    const Kvdepot__V1__CodecSpec *pb = pb_spec;
    if (!pb)
        return 0;
    out->codec = (kvdepot_codec)pb->codec;
    if (pb->quant) {
        out->group_size = pb->quant->group_size;
        out->stochastic = pb->quant->rounding == KVDEPOT__V1__ROUNDING__ROUNDING_STOCHASTIC;
        out->axis = (kvdepot_quant_axis)pb->quant->axis;
        out->seed = pb->quant->seed;
    }
    if (pb->vq) {
        out->vq_sub_dim = pb->vq->sub_dim;
        out->vq_bits = pb->vq->bits;
    }
    if (pb->svd) {
        out->svd_removal_rate = pb->svd->removal_rate;
        out->svd_align = pb->svd->align;
    }
    if (pb->svd && pb->svd->n_kept_widths) {
        uint32_t *w = malloc(pb->svd->n_kept_widths * sizeof *w);
        if (!w)
            return -1;
        memcpy(w, pb->svd->kept_widths, pb->svd->n_kept_widths * sizeof *w);
        out->svd_widths = w;
        out->svd_num_widths = pb->svd->n_kept_widths;
    }
    return 0;
}

void kvdepot_sequence_list_free(kvdepot_sequence_info *list, size_t count)
{
    if (!list)
        return;
    for (size_t i = 0; i < count; i++)
        kvdepot_sequence_info_clear(&list[i]);
    free(list);
}

int kvdepot__info_from_pb(kvdepot_client *c, const void *pb_info, kvdepot_sequence_info *out)
{
    const Kvdepot__V1__SequenceInfo *pb = pb_info;
    memset(out, 0, sizeof *out);
    if (!pb)
        return KVDEPOT_OK;
    out->id_len = pb->sequence_id.len < KVDEPOT_ID_MAX ? pb->sequence_id.len : KVDEPOT_ID_MAX;
    if (out->id_len)
        memcpy(out->id, pb->sequence_id.data, out->id_len);
    copy_str(out->model, sizeof out->model, pb->model);
    out->num_tokens = pb->num_tokens;
    out->page_tokens = pb->page_tokens;
    out->sealed_pages = pb->sealed_pages;
    out->stored_bytes = pb->stored_bytes;
    out->pq_index_bytes = pb->pq_index_bytes;
    out->created_unix_ms = pb->created_unix_ms;
    out->prefix_blocks = pb->prefix_blocks;
    out->activation_tokens = pb->activation_tokens;
    if (pb->recovery_loss) {
        out->recovery_loss = 1;
        out->loss_acknowledged_tokens = pb->recovery_loss->acknowledged_tokens;
        out->loss_recovered_tokens = pb->recovery_loss->recovered_tokens;
        out->loss_unix_ms = pb->recovery_loss->recovered_unix_ms;
    }
    if (pb->n_layer_tokens) {
        out->layer_tokens = malloc(pb->n_layer_tokens * sizeof(uint64_t));
        if (!out->layer_tokens)
            goto nomem;
        memcpy(out->layer_tokens, pb->layer_tokens, pb->n_layer_tokens * sizeof(uint64_t));
        out->num_layers = pb->n_layer_tokens;
    }
    if (pb->n_block_hashes) {
        out->block_hashes = malloc(pb->n_block_hashes * sizeof(uint64_t));
        if (!out->block_hashes)
            goto nomem;
        memcpy(out->block_hashes, pb->block_hashes, pb->n_block_hashes * sizeof(uint64_t));
        out->num_block_hashes = pb->n_block_hashes;
    }
    if (pb->codecs) {
        const Kvdepot__V1__SequenceCodecs *cp = pb->codecs;
        out->have_codecs = 1;
        if (kvdepot__spec_from_pb(cp->k, &out->codecs.k) ||
            kvdepot__spec_from_pb(cp->v, &out->codecs.v))
            goto nomem;
        if (cp->pq) {
            out->codecs.pq_m = cp->pq->m;
            out->codecs.pq_bits = cp->pq->bits;
            out->codecs.pq_iterations = cp->pq->iterations;
            out->codecs.pq_min_train_tokens = cp->pq->min_train_tokens;
        }
        out->codecs.raw_sink_tokens = cp->raw_sink_tokens;
        out->codecs.store_activations = cp->store_activations;
        out->artifacts_fingerprint = cp->artifacts_fingerprint;
    }
    return KVDEPOT_OK;
nomem:
    kvdepot_sequence_info_clear(out);
    return kvdepot__fail(c, KVDEPOT_ENOMEM, "sequence info: out of memory");
}

int kvdepot__create_pb(kvdepot_client *c, const kvdepot_create_args *a, const char *what,
                       Kvdepot__V1__CreateSequenceRequest *req, kvdepot__codecs_pb *cpb)
{
    kvdepot__v1__create_sequence_request__init(req);
    if (!a || !a->model || (!a->id && a->id_len) || (!a->prefix_hashes && a->num_prefix_hashes) ||
        (!a->prefix_token_ids && a->num_prefix_token_ids))
        return kvdepot__fail(c, KVDEPOT_EINVAL, "%s: NULL argument", what);
    req->sequence_id.data = (uint8_t *)a->id;
    req->sequence_id.len = a->id_len;
    req->model = (char *)a->model;
    req->prefix_hashes = (uint64_t *)a->prefix_hashes;
    req->n_prefix_hashes = a->num_prefix_hashes;
    req->prefix_token_ids = (uint32_t *)a->prefix_token_ids;
    req->n_prefix_token_ids = a->num_prefix_token_ids;
    req->ttl_seconds = a->ttl_seconds;
    req->codecs = kvdepot__codecs_to_pb(a->codecs, cpb);
    int rc = kvdepot__engine_pb(c, &a->engine_prefix, what, &req->engine_prefix_hashes);
    if (rc)
        return rc;
    req->n_engine_prefix_hashes = a->engine_prefix.num;
    req->engine_block_tokens = a->engine_prefix.block_tokens;
    return KVDEPOT_OK;
}

int kvdepot_sequence_create(kvdepot_client *c, const kvdepot_create_args *a,
                            kvdepot_sequence_info *out)
{
    if (c && c->cluster)
        return kvdepot__cluster_sequence_create(c, a, out);
    kvdepot__clear_error();
    if (out)
        memset(out, 0, sizeof *out);
    if (!c)
        return kvdepot__fail(c, KVDEPOT_EINVAL, "sequence create: NULL argument");
    Kvdepot__V1__CreateSequenceRequest req;
    kvdepot__codecs_pb cpb;
    int rc = kvdepot__create_pb(c, a, "sequence create", &req, &cpb);
    if (rc)
        return rc;
    Kvdepot__V1__CreateSequenceResponse *resp;
    rc = UNARY(c, KVDEPOT__CREATE_SEQUENCE, &req, kvdepot__v1__create_sequence_response, &resp);
    free(req.engine_prefix_hashes);
    if (rc)
        return rc;
    if (out)
        rc = kvdepot__info_from_pb(c, resp->sequence, out);
    protobuf_c_message_free_unpacked(&resp->base, NULL);
    return rc;
}

int kvdepot_sequence_stat(kvdepot_client *c, const void *id, size_t id_len,
                          kvdepot_sequence_info *out)
{
    if (c && c->cluster)
        return kvdepot__cluster_sequence_stat(c, id, id_len, out);
    kvdepot__clear_error();
    if (out)
        memset(out, 0, sizeof *out);
    if (!c || (!id && id_len))
        return kvdepot__fail(c, KVDEPOT_EINVAL, "sequence stat: NULL argument");
    Kvdepot__V1__StatSequenceRequest req = KVDEPOT__V1__STAT_SEQUENCE_REQUEST__INIT;
    req.sequence_id.data = (uint8_t *)id;
    req.sequence_id.len = id_len;
    Kvdepot__V1__StatSequenceResponse *resp;
    int rc = UNARY(c, KVDEPOT__STAT_SEQUENCE, &req, kvdepot__v1__stat_sequence_response, &resp);
    if (rc)
        return rc;
    if (out)
        rc = kvdepot__info_from_pb(c, resp->sequence, out);
    protobuf_c_message_free_unpacked(&resp->base, NULL);
    return rc;
}

int kvdepot_sequence_list(kvdepot_client *c, const char *model, kvdepot_sequence_info **out,
                          size_t *count)
{
    if (c && c->cluster)
        return kvdepot__cluster_sequence_list(c, model, out, count);
    kvdepot__clear_error();
    if (out)
        *out = NULL;
    if (count)
        *count = 0;
    if (!c || !out || !count)
        return kvdepot__fail(c, KVDEPOT_EINVAL, "sequence list: NULL argument");
    kvdepot_sequence_info *list = NULL;
    size_t n = 0, cap = 0;
    uint8_t *token = NULL;
    size_t token_len = 0;
    int rc = KVDEPOT_OK;
    for (;;) {
        Kvdepot__V1__ListSequencesRequest req = KVDEPOT__V1__LIST_SEQUENCES_REQUEST__INIT;
        req.model = (char *)(model ? model : "");
        req.page_token.data = token;
        req.page_token.len = token_len;
        Kvdepot__V1__ListSequencesResponse *resp;
        rc = UNARY(c, KVDEPOT__LIST_SEQUENCES, &req, kvdepot__v1__list_sequences_response, &resp);
        if (rc)
            break;
        if (n + resp->n_sequences > cap) {
            size_t ncap = cap ? cap * 2 : 16;
            while (ncap < n + resp->n_sequences)
                ncap *= 2;
            kvdepot_sequence_info *nl = realloc(list, ncap * sizeof *nl);
            if (!nl) {
                protobuf_c_message_free_unpacked(&resp->base, NULL);
                rc = kvdepot__fail(c, KVDEPOT_ENOMEM, "sequence list: out of memory");
                break;
            }
            list = nl;
            cap = ncap;
        }
        for (size_t i = 0; i < resp->n_sequences && rc == KVDEPOT_OK; i++) {
            rc = kvdepot__info_from_pb(c, resp->sequences[i], &list[n]);
            if (rc == KVDEPOT_OK)
                n++;
        }
        int more = resp->next_page_token.len > 0;
        /* A server that hands back the token it was given would loop forever. */
        if (more && token_len == resp->next_page_token.len &&
            memcmp(token, resp->next_page_token.data, token_len) == 0)
            rc = kvdepot__fail(c, KVDEPOT_EINTERNAL, "sequence list: server repeated its page token");
        if (rc == KVDEPOT_OK && more) {
            uint8_t *nt = malloc(resp->next_page_token.len);
            if (!nt) {
                rc = kvdepot__fail(c, KVDEPOT_ENOMEM, "sequence list: out of memory");
            } else {
                memcpy(nt, resp->next_page_token.data, resp->next_page_token.len);
                free(token);
                token = nt;
                token_len = resp->next_page_token.len;
            }
        }
        protobuf_c_message_free_unpacked(&resp->base, NULL);
        if (rc || !more)
            break;
    }
    free(token);
    if (rc) {
        kvdepot_sequence_list_free(list, n);
        return rc;
    }
    if (n == 0) {
        free(list);
        list = NULL;
    }
    *out = list;
    *count = n;
    return KVDEPOT_OK;
}

int kvdepot_sequence_delete(kvdepot_client *c, const void *id, size_t id_len, uint64_t *freed)
{
    if (c && c->cluster)
        return kvdepot__cluster_sequence_delete(c, id, id_len, freed);
    kvdepot__clear_error();
    if (freed)
        *freed = 0;
    if (!c || (!id && id_len))
        return kvdepot__fail(c, KVDEPOT_EINVAL, "sequence delete: NULL argument");
    Kvdepot__V1__DeleteSequenceRequest req = KVDEPOT__V1__DELETE_SEQUENCE_REQUEST__INIT;
    req.sequence_id.data = (uint8_t *)id;
    req.sequence_id.len = id_len;
    Kvdepot__V1__DeleteSequenceResponse *resp;
    int rc = UNARY(c, KVDEPOT__DELETE_SEQUENCE, &req, kvdepot__v1__delete_sequence_response, &resp);
    if (rc)
        return rc;
    if (freed)
        *freed = resp->freed_pages;
    protobuf_c_message_free_unpacked(&resp->base, NULL);
    return KVDEPOT_OK;
}

/* ------------------------------------------------------------------------ */
/* Prefix sharing                                                            */
/* ------------------------------------------------------------------------ */

uint64_t kvdepot_prefix_hash(uint64_t parent, const uint32_t *token_ids, size_t n)
{
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    return XXH3_64bits_withSeed(token_ids, n * sizeof(uint32_t), parent);
#else
    /* The hash is defined over little-endian ids; swap in small batches. */
    XXH3_state_t *st = XXH3_createState();
    XXH3_64bits_reset_withSeed(st, parent);
    uint32_t buf[256];
    for (size_t i = 0; i < n;) {
        size_t m = n - i < 256 ? n - i : 256;
        for (size_t j = 0; j < m; j++)
            buf[j] = __builtin_bswap32(token_ids[i + j]);
        XXH3_64bits_update(st, buf, m * sizeof(uint32_t));
        i += m;
    }
    uint64_t h = XXH3_64bits_digest(st);
    XXH3_freeState(st);
    return h;
#endif
}

size_t kvdepot_prefix_hash_chain(const uint32_t *token_ids, size_t n, size_t page_tokens,
                                 uint64_t *out)
{
    if (!page_tokens)
        return 0;
    size_t blocks = n / page_tokens;
    if (out) {
        uint64_t h = 0;
        for (size_t i = 0; i < blocks; i++) {
            h = kvdepot_prefix_hash(h, token_ids + i * page_tokens, page_tokens);
            out[i] = h;
        }
    }
    return blocks;
}

/* The Lookup call of both kinds of chain; the outputs were zeroed. */
static int lookup_rpc(kvdepot_client *c, const Kvdepot__V1__LookupRequest *req,
                      uint64_t *matched_blocks, uint64_t *matched_tokens)
{
    Kvdepot__V1__LookupResponse *resp;
    int rc = UNARY(c, KVDEPOT__LOOKUP, req, kvdepot__v1__lookup_response, &resp);
    if (rc)
        return rc;
    if (matched_blocks)
        *matched_blocks = resp->matched_blocks;
    if (matched_tokens)
        *matched_tokens = resp->matched_tokens;
    protobuf_c_message_free_unpacked(&resp->base, NULL);
    return KVDEPOT_OK;
}

uint64_t kvdepot_engine_hash_key(const void *name, size_t len)
{
    return name || !len ? XXH3_64bits(name, len) : 0;
}

int kvdepot__engine_pb(kvdepot_client *c, const kvdepot_engine_hashes *h, const char *what,
                       ProtobufCBinaryData **out)
{
    *out = NULL;
    if (!h->num)
        return KVDEPOT_OK;
    if (!h->bytes || h->len < 1 || h->len > 64)
        return kvdepot__fail(c, KVDEPOT_EINVAL,
                             "%s: engine hashes need bytes and a length of 1..64 (%zu given)", what,
                             h->len);
    ProtobufCBinaryData *b = malloc(sizeof *b * h->num);
    if (!b)
        return kvdepot__fail(c, KVDEPOT_ENOMEM, "%s: out of memory", what);
    for (size_t i = 0; i < h->num; i++)
        b[i] = (ProtobufCBinaryData){h->len, (uint8_t *)h->bytes + i * h->len};
    *out = b;
    return KVDEPOT_OK;
}

int kvdepot_engine_lookup(kvdepot_client *c, const char *model, const kvdepot_engine_hashes *h,
                          uint64_t *matched_blocks, uint64_t *matched_tokens)
{
    if (c && c->cluster && h)
        return kvdepot__cluster_engine_lookup(c, model, h, matched_blocks, matched_tokens);
    kvdepot__clear_error();
    if (matched_blocks)
        *matched_blocks = 0;
    if (matched_tokens)
        *matched_tokens = 0;
    if (!c || !model || !h)
        return kvdepot__fail(c, KVDEPOT_EINVAL, "engine lookup: NULL argument");
    Kvdepot__V1__LookupRequest req = KVDEPOT__V1__LOOKUP_REQUEST__INIT;
    req.model = (char *)model;
    int rc = kvdepot__engine_pb(c, h, "engine lookup", &req.engine_block_hashes);
    if (rc)
        return rc;
    req.n_engine_block_hashes = h->num;
    req.engine_block_tokens = h->block_tokens;
    rc = lookup_rpc(c, &req, matched_blocks, matched_tokens);
    free(req.engine_block_hashes);
    return rc;
}

int kvdepot_prefix_lookup(kvdepot_client *c, const char *model, const uint64_t *hashes, size_t n,
                          uint64_t *matched_blocks, uint64_t *matched_tokens)
{
    if (c && c->cluster)
        return kvdepot__cluster_prefix_lookup(c, model, hashes, n, matched_blocks, matched_tokens);
    kvdepot__clear_error();
    if (matched_blocks)
        *matched_blocks = 0;
    if (matched_tokens)
        *matched_tokens = 0;
    if (!c || !model || (!hashes && n))
        return kvdepot__fail(c, KVDEPOT_EINVAL, "lookup: NULL argument");
    Kvdepot__V1__LookupRequest req = KVDEPOT__V1__LOOKUP_REQUEST__INIT;
    req.model = (char *)model;
    req.block_hashes = (uint64_t *)hashes;
    req.n_block_hashes = n;
    return lookup_rpc(c, &req, matched_blocks, matched_tokens);
}

/* ------------------------------------------------------------------------ */
/* Tiers                                                                     */
/* ------------------------------------------------------------------------ */

int kvdepot_stats_get(kvdepot_client *c, kvdepot_stats *out)
{
    kvdepot__clear_error();
    if (out)
        memset(out, 0, sizeof *out);
    if (!c || !out)
        return kvdepot__fail(c, KVDEPOT_EINVAL, "stats: NULL argument");
    if (c->cluster)
        return kvdepot__fail(c, KVDEPOT_EUNSUPP, "stats: ask each server of a sharded address");
    Kvdepot__V1__StatsRequest req = KVDEPOT__V1__STATS_REQUEST__INIT;
    Kvdepot__V1__StatsResponse *resp;
    int rc = UNARY(c, KVDEPOT__STATS, &req, kvdepot__v1__stats_response, &resp);
    if (rc)
        return rc;
    snprintf(out->durability, sizeof out->durability, "%s",
             resp->durability ? resp->durability : "");
    for (size_t i = 0; i < resp->n_tiers && i < 3; i++) {
        const Kvdepot__V1__TierStats *t = resp->tiers[i];
        kvdepot_tier_stats *o = &out->tiers[i];
        snprintf(o->name, sizeof o->name, "%s", t->name ? t->name : "");
        o->limit_bytes = t->limit_bytes;
        o->bytes = t->bytes;
        o->pages = t->pages;
        o->hits = t->hits;
        o->evictions = t->evictions;
        out->num_tiers = i + 1;
    }
    out->misses = resp->misses;
    out->promotions = resp->promotions;
    out->prefetched = resp->prefetched;
    out->checksum_failures = resp->checksum_failures;
    out->sequences_dropped = resp->sequences_dropped;
    out->sequences_expired = resp->sequences_expired;
    out->sequences = resp->sequences;
    snprintf(out->backend, sizeof out->backend, "%s", resp->backend ? resp->backend : "");
    out->backend_threads = resp->backend_threads;
    snprintf(out->device, sizeof out->device, "%s", resp->device ? resp->device : "");
    out->device_memory_bytes = resp->device_memory_bytes;
    out->device_healthy = resp->device_healthy;
    out->device_pages_attended = resp->device_pages_attended;
    out->device_pages_searched = resp->device_pages_searched;
    out->device_pages_encoded = resp->device_pages_encoded;
    out->device_fallbacks = resp->device_fallbacks;
    out->device_pages_placed = resp->device_pages_placed;
    if (resp->memory) {
        out->mem_rss_bytes = resp->memory->rss_bytes;
        out->mem_appends_bytes = resp->memory->appends_bytes;
        out->mem_memtables_bytes = resp->memory->memtables_bytes;
        out->mem_block_cache_bytes = resp->memory->block_cache_bytes;
    }
    protobuf_c_message_free_unpacked(&resp->base, NULL);
    return KVDEPOT_OK;
}

int kvdepot_backup(kvdepot_client *c, const char *dir, kvdepot_backup_info *out)
{
    kvdepot__clear_error();
    if (out)
        memset(out, 0, sizeof *out);
    if (!c || !dir)
        return kvdepot__fail(c, KVDEPOT_EINVAL, "backup: NULL argument");
    if (c->cluster)
        return kvdepot__fail(c, KVDEPOT_EUNSUPP,
                             "backup: a client over several servers backs up each one itself");
    Kvdepot__V1__BackupRequest req = KVDEPOT__V1__BACKUP_REQUEST__INIT;
    req.dir = (char *)dir;
    Kvdepot__V1__BackupResponse *resp;
    int rc = UNARY(c, KVDEPOT__BACKUP, &req, kvdepot__v1__backup_response, &resp);
    if (rc)
        return rc;
    if (out) {
        out->files = resp->files;
        out->bytes = resp->bytes;
        out->duration_ms = resp->duration_ms;
    }
    protobuf_c_message_free_unpacked(&resp->base, NULL);
    return KVDEPOT_OK;
}

int kvdepot_sequence_evict(kvdepot_client *c, const void *id, size_t id_len, uint64_t *pages,
                           uint64_t *bytes)
{
    if (c && c->cluster)
        return kvdepot__cluster_sequence_evict(c, id, id_len, pages, bytes);
    kvdepot__clear_error();
    if (pages)
        *pages = 0;
    if (bytes)
        *bytes = 0;
    if (!c || (!id && id_len))
        return kvdepot__fail(c, KVDEPOT_EINVAL, "sequence evict: NULL argument");
    if (c->cluster)
        return kvdepot__fail(c, KVDEPOT_EUNSUPP,
                             "sequence evict: not supported over several servers");
    Kvdepot__V1__EvictSequenceRequest req = KVDEPOT__V1__EVICT_SEQUENCE_REQUEST__INIT;
    req.sequence_id.data = (uint8_t *)id;
    req.sequence_id.len = id_len;
    Kvdepot__V1__EvictSequenceResponse *resp;
    int rc = UNARY(c, KVDEPOT__EVICT_SEQUENCE, &req, kvdepot__v1__evict_sequence_response, &resp);
    if (rc)
        return rc;
    if (pages)
        *pages = resp->pages;
    if (bytes)
        *bytes = resp->bytes;
    protobuf_c_message_free_unpacked(&resp->base, NULL);
    return KVDEPOT_OK;
}
