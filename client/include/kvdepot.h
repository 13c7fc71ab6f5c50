/*
 * kvdepot.h — C client library for the kvdepot key/value cache service.
 *
 * libkvdepot talks to a kvdepotd server over gRPC (wire API kvdepot.v1, see
 * proto/kvdepot/v1/kvdepot.proto). One C function per RPC; streams are
 * chunked inside the library, so callers pass and receive whole tensors.
 *
 * Conventions
 *   - Every fallible function returns KVDEPOT_OK (0) or a negative
 *     kvdepot_status: the negated gRPC status code the server answered with
 *     (KVDEPOT_ENOTFOUND = -NOT_FOUND, ...) or one the library chose for a
 *     local failure (KVDEPOT_EINVAL for bad arguments, KVDEPOT_ENOMEM when
 *     an allocation failed, KVDEPOT_EINTERNAL for a malformed response).
 *   - After a failure, kvdepot_errmsg() returns a message naming the problem
 *     (the server's status details, or the library's own description). The
 *     message is kept per thread, so concurrent callers never see each
 *     other's errors.
 *   - Out-parameters are left zeroed / NULL on failure.
 *   - Memory the library returns is owned by the caller and freed with the
 *     function named in each description; nothing returned points into the
 *     client, so it stays valid after kvdepot_close().
 *   - A kvdepot_client is thread-safe: any number of threads may issue calls
 *     on one handle at the same time. Each call is independent (its own gRPC
 *     call and completion queue) and blocks until it finishes or its
 *     deadline passes.
 *   - The library never prints; it reports through an optional log callback.
 *   - An output struct may be the input struct of the same call only where
 *     the function says so (kvdepot_model_put's model and out).
 *   - kvdepot_close() needs every call on the handle to have returned and
 *     every transfer started on it (kvdepot_append_start, ..._read_start)
 *     to have been waited for: it does not wait, and using the handle
 *     afterwards, or a transfer of it, is undefined.
 *   - fork(): gRPC's threads do not follow into the child. A child process
 *     must not use a client its parent created (nor close it); it connects
 *     its own with kvdepot_connect(). The parent's client is unaffected.
 *   - Retries: the library does not repeat a call that may have reached the
 *     server (a client over several servers retries only connecting).
 *     After UNAVAILABLE or DEADLINE_EXCEEDED a call may or may not have
 *     taken effect, and these are safe to repeat as they are: every read
 *     (model get/list, sequence stat/list/read, lookup, attend, search,
 *     sparse attend, plan fetch, stats, health, artifacts get); model put
 *     of the same model (the repeat answers created = 0); sequence delete
 *     and evict (a repeat of a delete that took effect answers NOT_FOUND);
 *     appends (atomic, and placed at token_start: a repeat of one that
 *     committed answers FAILED_PRECONDITION "token_start N != layer L
 *     length M" and changes nothing); artifacts upload (replaces);
 *     calibrate (the same samples and seed give the same artifacts). A
 *     repeated sequence create answers ALREADY_EXISTS when the first took
 *     effect (stat the sequence), a repeated backup ALREADY_EXISTS (look
 *     at the directory: the first may have completed).
 *
 * Tensor layout (Append and Read): K and V are each laid out as
 *     [layer][token][kv_head][head_dim]      row-major, little-endian
 * in the model's dtype, for the layer range and token range of the call.
 * K and V of one call therefore have the same size, kvdepot_kv_bytes().
 */
#ifndef KVDEPOT_H
#define KVDEPOT_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KVDEPOT_VERSION_MAJOR 0
#define KVDEPOT_VERSION_MINOR 1
#define KVDEPOT_VERSION_PATCH 0

/* ------------------------------------------------------------------------ */
/* Status codes                                                              */
/* ------------------------------------------------------------------------ */

/* Return codes: 0 or a negated gRPC status code. */
typedef enum kvdepot_status {
    KVDEPOT_OK = 0,
    KVDEPOT_ECANCELLED = -1,  /* CANCELLED: the call was cancelled */
    KVDEPOT_EUNKNOWN = -2,    /* UNKNOWN */
    KVDEPOT_EINVAL = -3,      /* INVALID_ARGUMENT: malformed request, bad shape/size/range */
    KVDEPOT_ETIMEDOUT = -4,   /* DEADLINE_EXCEEDED: the per-call deadline passed */
    KVDEPOT_ENOTFOUND = -5,   /* NOT_FOUND: unknown model, sequence or prefix page */
    KVDEPOT_EEXIST = -6,      /* ALREADY_EXISTS: model or sequence id taken */
    KVDEPOT_EPERM = -7,       /* PERMISSION_DENIED */
    KVDEPOT_ENOMEM = -8,      /* RESOURCE_EXHAUSTED: a limit was hit, or out of memory */
    KVDEPOT_EPRECOND = -9,    /* FAILED_PRECONDITION: e.g. append not at the layer's end */
    KVDEPOT_EABORTED = -10,   /* ABORTED */
    KVDEPOT_ERANGE = -11,     /* OUT_OF_RANGE: read past the stored tokens */
    KVDEPOT_EUNSUPP = -12,    /* UNIMPLEMENTED: the server lacks the RPC */
    KVDEPOT_EINTERNAL = -13,  /* INTERNAL: server fault, or a malformed response */
    KVDEPOT_EUNAVAIL = -14,   /* UNAVAILABLE: cannot reach the server, or it is stopping */
    KVDEPOT_ECORRUPT = -15,   /* DATA_LOSS: a stored page failed its checksum */
    KVDEPOT_EAUTH = -16       /* UNAUTHENTICATED */
} kvdepot_status;

typedef struct kvdepot_client kvdepot_client;

/*
 * Generic description of a status ("not found"); "ok" for 0. Never NULL;
 * the string is static.
 */
const char *kvdepot_strerror(int status);

/*
 * gRPC name of a status ("NOT_FOUND"); "OK" for 0, "UNKNOWN" for values that
 * are not a kvdepot_status. Never NULL; the string is static.
 */
const char *kvdepot_status_name(int status);

/* The library's version, "MAJOR.MINOR.PATCH" (static storage). */
const char *kvdepot_version(void);

/*
 * The message of the last failed kvdepot call made by the calling thread,
 * e.g. `no such sequence "abc"` (without the status name). Empty string when
 * the last call on this thread succeeded.
 *
 * @param[in] client  the handle the call was made on, or NULL (kvdepot_connect
 *                    failures). The message is per thread, not per client:
 *                    the argument only documents intent.
 * @return a NUL-terminated string in thread-local storage, valid until the
 *         next kvdepot call on the same thread. Never NULL.
 */
const char *kvdepot_errmsg(const kvdepot_client *client);

/* Release memory the library returned (model lists, read buffers). NULL is a
 * no-op. */
void kvdepot_free(void *ptr);

/* ------------------------------------------------------------------------ */
/* Element types                                                             */
/* ------------------------------------------------------------------------ */

/* Element type of K and V, with the numbers of kvdepot.v1.DType. */
typedef enum kvdepot_dtype {
    KVDEPOT_DTYPE_UNSPECIFIED = 0,
    KVDEPOT_DTYPE_F16 = 1,   /* IEEE binary16 */
    KVDEPOT_DTYPE_BF16 = 2,  /* bfloat16 */
    KVDEPOT_DTYPE_F32 = 3    /* IEEE binary32 */
} kvdepot_dtype;

/* Bytes per element (2, 2, 4); 0 for KVDEPOT_DTYPE_UNSPECIFIED or an unknown value. */
size_t kvdepot_dtype_size(kvdepot_dtype dtype);

/* "f16", "bf16", "f32"; "unspecified" otherwise. Static string. */
const char *kvdepot_dtype_name(kvdepot_dtype dtype);

/*
 * Parse "f16", "bf16" or "f32" (also "float16", "bfloat16", "float32").
 * @param[in]  name  the text
 * @param[out] out   the dtype
 * @return KVDEPOT_OK, or KVDEPOT_EINVAL for any other text.
 */
int kvdepot_dtype_parse(const char *name, kvdepot_dtype *out);

/* ------------------------------------------------------------------------ */
/* Connecting                                                                */
/* ------------------------------------------------------------------------ */

typedef enum kvdepot_log_level {
    KVDEPOT_LOG_ERROR = 0,
    KVDEPOT_LOG_WARN = 1,
    KVDEPOT_LOG_INFO = 2,
    KVDEPOT_LOG_DEBUG = 3
} kvdepot_log_level;

/*
 * Log callback. Called from the thread that made the call, possibly from
 * several threads at once; `msg` is valid only during the callback.
 */
typedef void (*kvdepot_log_fn)(void *user, kvdepot_log_level level, const char *msg);

typedef struct kvdepot_options {
    /* gRPC target, e.g. "127.0.0.1:50051", "dns:///kv.example:50051",
     * "unix:/run/kvdepot.sock". Copied by kvdepot_connect. */
    const char *address;
    /* Deadline of each call in milliseconds, covering the whole stream of an
     * Append or Read; 0 = no deadline. Default 60000. */
    uint32_t deadline_ms;
    /* Largest gRPC message sent or received, in bytes. Must be at least the
     * server's Read chunk size and at least chunk_bytes + 64 KiB. Default 8 MiB. */
    size_t max_message_bytes;
    /* Bytes of K/V data per Append message, and the max_chunk_bytes asked of
     * the server on Read. 4 KiB..4 MiB. Default 1 MiB. */
    size_t chunk_bytes;
    /* When nonzero, calls made while the server is unreachable wait (up to
     * their deadline) for it to come back instead of failing at once with
     * KVDEPOT_EUNAVAIL. Default 0. */
    int wait_for_ready;
    /* Optional log callback, its user pointer, and the most verbose level
     * passed to it. Default: none, KVDEPOT_LOG_WARN. */
    kvdepot_log_fn log;
    void *log_user;
    kvdepot_log_level log_level;
    /* Several servers (see "Several servers" below; used only when the
     * address names more than one endpoint). connect_timeout_ms: how long a
     * call waits for a connection to a server before counting it
     * unreachable. Default 1000. */
    uint32_t connect_timeout_ms;
    /* Further attempts on an unreachable server within one call, with a
     * pause of shard_backoff_ms doubled each time, before the call gives
     * up. Default 1. */
    uint32_t shard_retries;
    /* After a call gave up on a server, calls for its keys fail at once for
     * shard_backoff_ms << (failures so far), at most 32 x shard_backoff_ms.
     * Default 100. */
    uint32_t shard_backoff_ms;
    /* How often shards:HOST:PORT names are resolved again; 0 = only after a
     * server failed. Default 30000. */
    uint32_t resolve_interval_ms;
    /* Transport security. tls: nonzero to connect with TLS; any of the files
     * below implies it. tls_ca_file: PEM roots the server's certificate must
     * chain to (NULL = the system's roots). tls_cert_file, tls_key_file:
     * the client's certificate and key, both or neither, for servers that
     * require one (mTLS). tls_server_name: the name the server certificate
     * must carry when it differs from the host in the address (NULL = that
     * host). The files are read by kvdepot_connect; a file that cannot be
     * read fails it with KVDEPOT_EINVAL. Default: plaintext. */
    int tls;
    const char *tls_ca_file;
    const char *tls_cert_file;
    const char *tls_key_file;
    const char *tls_server_name;
    /* Bearer token sent with every call as `authorization: Bearer <token>`
     * (servers run with a tokens file require one). NULL = none. Copied by
     * kvdepot_connect. */
    const char *token;
} kvdepot_options;

/*
 * Fill opt with the defaults listed in kvdepot_options.
 * @param[out] opt  options to initialise
 */
void kvdepot_options_init(kvdepot_options *opt);

/*
 * Create a client for one server. Creates the gRPC channel but does not
 * contact the server: the connection is made by the first call (use
 * kvdepot_health_check to probe it).
 *
 * @param[in]  opt  options (see kvdepot_options_init); NULL = defaults.
 *                  Not referenced after the call returns.
 * @param[out] out  the new client, to be released with kvdepot_close();
 *                  NULL on failure.
 * @return KVDEPOT_OK; KVDEPOT_EINVAL for a missing address or out-of-range
 *         sizes; KVDEPOT_ENOMEM; KVDEPOT_EINTERNAL when gRPC refuses the
 *         channel.
 */
int kvdepot_connect(const kvdepot_options *opt, kvdepot_client **out);

/*
 * Close the client and free its resources. No call may be in progress on
 * the handle. NULL is a no-op.
 */
void kvdepot_close(kvdepot_client *client);

/*
 * Progress of the bulk transfers: fn(user, done, total) is called as
 * kvdepot_sequence_append sends its data (K, V and X bytes handed to the
 * transport so far) and as kvdepot_sequence_read receives it (bytes
 * received), after each chunk (kvdepot_options.chunk_bytes) and once more
 * with done == total when all of it has gone or arrived. It runs on the
 * thread that runs the transfer (the caller's; a pool thread for the
 * non-blocking transfers) and must not call back into the client. For a
 * client over several servers it reports each call's own bytes. fn NULL
 * turns it off. Set it while no call is in flight on the handle.
 */
typedef void (*kvdepot_progress_fn)(void *user, uint64_t done, uint64_t total);
void kvdepot_set_progress(kvdepot_client *client, kvdepot_progress_fn fn, void *user);

/* ------------------------------------------------------------------------ */
/* Health                                                                    */
/* ------------------------------------------------------------------------ */

/* grpc.health.v1.HealthCheckResponse.ServingStatus */
typedef enum kvdepot_serving {
    KVDEPOT_SERVING_UNKNOWN = 0,
    KVDEPOT_SERVING = 1,
    KVDEPOT_NOT_SERVING = 2,
    KVDEPOT_SERVICE_UNKNOWN = 3
} kvdepot_serving;

/*
 * grpc.health.v1.Health/Check.
 * @param[in]  client
 * @param[in]  service  service name, or NULL / "" for the whole server
 * @param[out] out      the serving status (may be NULL)
 * @return KVDEPOT_OK when the server answered (whatever the status);
 *         KVDEPOT_EUNAVAIL when it cannot be reached; KVDEPOT_ENOTFOUND for
 *         an unknown service name; KVDEPOT_ETIMEDOUT.
 */
int kvdepot_health_check(kvdepot_client *client, const char *service, kvdepot_serving *out);

/* ------------------------------------------------------------------------ */
/* Models                                                                    */
/* ------------------------------------------------------------------------ */

#define KVDEPOT_NAME_MAX 128  /* bytes of a model name or revision */

/* A registered shape profile (kvdepot.v1.Model). */
typedef struct kvdepot_model {
    char name[KVDEPOT_NAME_MAX + 1];      /* [A-Za-z0-9._-]{1,128} */
    char revision[KVDEPOT_NAME_MAX + 1];  /* free text */
    uint32_t num_layers;                  /* 1..1024 */
    uint32_t num_kv_heads;                /* 1..1024 */
    uint32_t num_q_heads;                 /* multiple of num_kv_heads; 0 = num_kv_heads */
    uint32_t head_dim;                    /* 1..1024 */
    uint32_t hidden_size;                 /* 0 = unknown */
    kvdepot_dtype dtype;
    uint64_t created_unix_ms;             /* set by the server */
} kvdepot_model;

/*
 * Bytes of K (equal to the bytes of V) for num_layers × num_tokens of the
 * model: num_layers * num_tokens * num_kv_heads * head_dim * dtype size.
 * 0 when the product overflows size_t or the dtype is unknown.
 */
size_t kvdepot_kv_bytes(const kvdepot_model *model, uint32_t num_layers, uint64_t num_tokens);

/*
 * PutModel: register a model. Putting an identical model again succeeds
 * (created = 0).
 * @param[in]  client
 * @param[in]  model    the profile; created_unix_ms is ignored
 * @param[in]  replace  nonzero: replace a model of the same name with a
 *                      different shape (allowed only without sequences)
 * @param[out] out      the stored model (may be NULL, or model itself)
 * @param[out] created  1 if newly created, 0 if it existed (may be NULL)
 * @return KVDEPOT_OK; KVDEPOT_EINVAL for a bad name or shape;
 *         KVDEPOT_EEXIST when a different model has the name;
 *         KVDEPOT_EPRECOND when replacing a model that has sequences;
 *         transport errors (KVDEPOT_EUNAVAIL, KVDEPOT_ETIMEDOUT).
 */
int kvdepot_model_put(kvdepot_client *client, const kvdepot_model *model, int replace,
                      kvdepot_model *out, int *created);

/*
 * GetModel.
 * @param[in]  client
 * @param[in]  name
 * @param[out] out     the model
 * @return KVDEPOT_OK; KVDEPOT_ENOTFOUND; KVDEPOT_EINVAL for a bad name;
 *         transport errors.
 */
int kvdepot_model_get(kvdepot_client *client, const char *name, kvdepot_model *out);

/*
 * ListModels.
 * @param[in]  client
 * @param[out] out    array of *count models, to be freed with kvdepot_free();
 *                    NULL when there are none
 * @param[out] count  number of models
 * @return KVDEPOT_OK; KVDEPOT_ENOMEM; transport errors.
 */
int kvdepot_model_list(kvdepot_client *client, kvdepot_model **out, size_t *count);

/*
 * DeleteModel.
 * @param[in]  client
 * @param[in]  name
 * @param[in]  force              nonzero: delete its sequences too
 * @param[out] deleted_sequences  sequences deleted with it (may be NULL)
 * @return KVDEPOT_OK; KVDEPOT_ENOTFOUND; KVDEPOT_EPRECOND when the model
 *         has sequences and force is 0; transport errors.
 */
int kvdepot_model_delete(kvdepot_client *client, const char *name, int force,
                         uint64_t *deleted_sequences);

/* ------------------------------------------------------------------------ */
/* Sequences                                                                 */
/* ------------------------------------------------------------------------ */

#define KVDEPOT_ID_MAX 256  /* bytes of a sequence id */

/* How K or V pages are stored once they seal (kvdepot.v1.CodecSpec). The
 * last, partial page of a layer always stays raw. */
typedef enum kvdepot_codec {
    KVDEPOT_CODEC_RAW = 0,
    KVDEPOT_CODEC_INT2 = 1, /* 2-bit asymmetric groups (HACK), ~2.4-2.8 bits/value */
    KVDEPOT_CODEC_INT4 = 2, /* 4-bit asymmetric groups */
    KVDEPOT_CODEC_VQ = 3    /* vector quantization (VecInfer) with the model's calibrated
                               codebooks, b/d bits per value (d4b8 = 2) */
} kvdepot_codec;

/* Grouping axis of INT2/INT4 values. */
typedef enum kvdepot_quant_axis {
    KVDEPOT_AXIS_DEFAULT = 0, /* channel where group_size divides the page size, else token */
    KVDEPOT_AXIS_TOKEN = 1,   /* group_size values of head_dim of one token */
    KVDEPOT_AXIS_CHANNEL = 2  /* group_size tokens of one channel (KIVI keys, HACK values) */
} kvdepot_quant_axis;

typedef struct kvdepot_codec_spec {
    kvdepot_codec codec;
    uint32_t group_size;         /* 8, 16, 32, 64 or 128; 0 = 64 (smaller for small heads) */
    int stochastic;              /* 1 = stochastic rounding, 0 = nearest */
    kvdepot_quant_axis axis;
    uint64_t seed;               /* stochastic rounding seed */
    /* KVDEPOT_CODEC_VQ: sub-vector width d (2, 4 or 8) and bits b (4..12).
     * The model needs artifacts of this shape (kvdepot_calibrate with the
     * same VQ spec, or kvdepot_artifacts_upload): KEY_SMOOTHING and
     * VQ_CODEBOOK_K for K, VQ_CODEBOOK_V for V, every (layer, kv head). */
    uint32_t vq_sub_dim, vq_bits;
    /* SVD reduction (ZACK) before the codec (raw, INT2 or INT4; not VQ):
     * either a singular-value removal rate in (0, 1) (per-head widths from
     * the SVD_SPECTRUM artifact) or svd_num_widths explicit widths (1 for
     * every kv head, or one per kv head; 1..head_dim). Widths are rounded up
     * to a multiple of svd_align (0 = 8) and, for INT2/INT4 on the token
     * axis, of group_size. Needs the SVD_ROTATION artifacts. */
    double svd_removal_rate;
    const uint32_t *svd_widths;
    size_t svd_num_widths;
    uint32_t svd_align;
} kvdepot_codec_spec;

/* The codecs of a sequence (kvdepot.v1.SequenceCodecs). Zero = all raw. */
typedef struct kvdepot_codecs {
    kvdepot_codec_spec k;
    kvdepot_codec_spec v;
    /* Pages of blocks starting before this token stay raw (attention
     * sinks); rounded up to whole pages. */
    uint32_t raw_sink_tokens;
    /* PQ index on K for kvdepot_search / kvdepot_sparse_attend: pq_m
     * sub-spaces (0 = no index; must divide head_dim) of 2^pq_bits centroids
     * (4, 6 or 8; 0 = 8), pq_iterations K-means steps (0 = 10). */
    uint32_t pq_m;
    uint32_t pq_bits;
    uint32_t pq_iterations;
    /* 1 = keep the layer inputs X sent with kvdepot_sequence_append (KVPR:
     * a reader fetches X of the first tokens and recomputes their K/V, see
     * kvdepot_plan_fetch and kvdepot_read_args.activation_tokens). The
     * model must have a hidden_size (else KVDEPOT_EPRECOND); not with
     * prefix_hashes (KVDEPOT_EINVAL): activations start at token 0. */
    int store_activations;
    /* PQ index: a layer's centroids are trained by the first append that
     * seals a page of it and leaves it with at least this many tokens
     * (kvdepot.v1.PQSpec.min_train_tokens; 0 = 4096, the same index
     * whatever the chunking of a prefill); pages sealed before carry no
     * codes. */
    uint32_t pq_min_train_tokens;
} kvdepot_codecs;

/*
 * State of a sequence (kvdepot.v1.SequenceInfo). Filled by the library; the
 * arrays are owned by the struct and released by kvdepot_sequence_info_clear().
 */
typedef struct kvdepot_sequence_info {
    uint8_t id[KVDEPOT_ID_MAX];
    size_t id_len;
    char model[KVDEPOT_NAME_MAX + 1];
    uint64_t num_tokens;    /* tokens readable on every layer */
    uint64_t *layer_tokens; /* [num_layers] tokens stored per layer */
    size_t num_layers;
    uint32_t page_tokens;  /* tokens per page on the server */
    uint64_t sealed_pages; /* over all layers */
    uint64_t stored_bytes;
    uint64_t created_unix_ms;
    uint64_t prefix_blocks; /* leading blocks shared from the prefix index */
    uint64_t *block_hashes; /* [num_block_hashes] registered block hashes */
    size_t num_block_hashes;
    /* Leading tokens whose activations X are stored on every layer (a
     * sequence created with store_activations; see kvdepot_append_args.x). */
    uint64_t activation_tokens;
    /* kvdepot_sequence_stat: 1 when the server, started with --wal-recovery
     * point-in-time on a damaged write-ahead log, dropped acknowledged
     * writes of this sequence: tokens acknowledged (0: unknown, or it had
     * been deleted and came back), tokens that came back, and when. */
    int recovery_loss;
    uint64_t loss_acknowledged_tokens, loss_recovered_tokens, loss_unix_ms;
    /* How the sequence stores its pages, as the server reports it
     * (have_codecs = 0 when it does not: an older server): group sizes and
     * axes resolved (never 0 / KVDEPOT_AXIS_DEFAULT for INT2/INT4), PQ bits
     * and iterations as stored, store_activations as created. For an SVD
     * side, svd_widths holds the kept width of every (layer, kv head),
     * layer-major (svd_num_widths of them, owned by the info; svd_removal_rate
     * and svd_align read 0). artifacts_fingerprint: XXH3-64 of the artifact
     * snapshot the sequence codes with (0 = none). */
    int have_codecs;
    kvdepot_codecs codecs;
    uint64_t artifacts_fingerprint;
    /* The PQ index's records: centroids (kvdepot_pq_centroids_get) and the
     * codes of pages sealed before a layer was trained; part of
     * stored_bytes and of the tenant's byte quota. */
    uint64_t pq_index_bytes;
} kvdepot_sequence_info;

/* Free the arrays of info and zero it. NULL, or a zeroed info, is a no-op. */
void kvdepot_sequence_info_clear(kvdepot_sequence_info *info);

/* Arguments of kvdepot_sequence_create. Zero-initialise, then set. */
/*
 * Engine block hashes: an engine's own names for its blocks (vLLM's sha256
 * chain over 16-token blocks, SGLang's, LMCache's), passed as they are
 * instead of kvdepot's 64-bit chain. Names are opaque bytes, all `len`
 * bytes long in one call (1..64), hash i at bytes + i * len. block_tokens
 * is the engine's block size and must divide the server's page_tokens; a
 * page is known by the name of its last engine block, so names must stand
 * for the whole prefix up to their block (chained, as engines' hashes are).
 * The server keys names by the caller's tenant and the model: tenants never
 * share or see each other's prefixes. Over several servers a chain lives
 * with kvdepot_shard_prefix_tag(kvdepot_engine_hash_key(first name)).
 */
typedef struct kvdepot_engine_hashes {
    const uint8_t *bytes; /* num * len bytes */
    size_t len;           /* bytes per name, 1..64 */
    size_t num;           /* names */
    uint32_t block_tokens;
} kvdepot_engine_hashes;

/* 64-bit key of an engine block name (XXH3-64 of its bytes): what a
 * sharded client routes an engine chain by (see kvdepot_shard_prefix_tag). */
uint64_t kvdepot_engine_hash_key(const void *name, size_t len);

typedef struct kvdepot_create_args {
    const void *id;            /* sequence id, 1..KVDEPOT_ID_MAX bytes */
    size_t id_len;
    const char *model;         /* model name */
    /* Optional: start from a stored prefix named by its block-hash chain
     * (see kvdepot_prefix_lookup); every hash must be stored. */
    const uint64_t *prefix_hashes;
    size_t num_prefix_hashes;
    /* Optional: the prefix's token ids (num_prefix_hashes * page_tokens of
     * them); checked against the hashes and kept for chaining later blocks. */
    const uint32_t *prefix_token_ids;
    size_t num_prefix_token_ids;
    /* Optional: delete the sequence this many seconds after its last
     * append (0 = keep until deleted). */
    uint64_t ttl_seconds;
    /* Optional: how pages are stored once they seal (NULL = raw). A spec
     * the model cannot take (group not dividing head_dim, channel axis on
     * K, VQ d/b out of range, SVD with VQ, ...) fails the call with
     * KVDEPOT_EINVAL; VQ or SVD on a model without the artifacts they need
     * (or with codebooks of another shape) with KVDEPOT_EPRECOND naming the
     * first missing one (run kvdepot_calibrate or upload artifacts). VQ and
     * SVD copy the model's artifacts into the sequence at creation: a later
     * recalibration does not change how its pages decode. */
    const kvdepot_codecs *codecs;
    /* Optional, instead of prefix_hashes: the stored prefix named by
     * engine block hashes (whole pages of them: num a multiple of
     * page_tokens / block_tokens, else KVDEPOT_EINVAL; every page stored,
     * else KVDEPOT_ENOTFOUND). prefix_token_ids then count the prefix's
     * tokens. */
    kvdepot_engine_hashes engine_prefix;
} kvdepot_create_args;

/*
 * CreateSequence.
 * @param[in]  client
 * @param[in]  args
 * @param[out] out     the new sequence (may be NULL); clear it with
 *                     kvdepot_sequence_info_clear()
 * @return KVDEPOT_OK; KVDEPOT_EINVAL for a bad id or prefix token ids that
 *         do not match the hashes, or bad codecs; KVDEPOT_EPRECOND for VQ/SVD
 *         codecs on a model without their artifacts; KVDEPOT_ENOTFOUND for an
 *         unknown model or a prefix hash that is not stored; KVDEPOT_EEXIST
 *         when the id is taken; transport errors.
 */
int kvdepot_sequence_create(kvdepot_client *client, const kvdepot_create_args *args,
                            kvdepot_sequence_info *out);

/*
 * StatSequence.
 * @param[in]  client
 * @param[in]  id, id_len  sequence id
 * @param[out] out         clear it with kvdepot_sequence_info_clear()
 * @return KVDEPOT_OK; KVDEPOT_ENOTFOUND; KVDEPOT_EINVAL for a bad id;
 *         transport errors.
 */
int kvdepot_sequence_stat(kvdepot_client *client, const void *id, size_t id_len,
                          kvdepot_sequence_info *out);

/*
 * ListSequences, all pages of it.
 * @param[in]  client
 * @param[in]  model  only this model's sequences; NULL or "" = all
 * @param[out] out    array of *count infos, to be freed with
 *                    kvdepot_sequence_list_free(); NULL when there are none
 * @param[out] count
 * @return KVDEPOT_OK; KVDEPOT_ENOTFOUND for an unknown model; KVDEPOT_ENOMEM;
 *         transport errors.
 */
int kvdepot_sequence_list(kvdepot_client *client, const char *model,
                          kvdepot_sequence_info **out, size_t *count);

/* Free a list from kvdepot_sequence_list(). NULL is a no-op. */
void kvdepot_sequence_list_free(kvdepot_sequence_info *list, size_t count);

/*
 * DeleteSequence.
 * @param[in]  client
 * @param[in]  id, id_len
 * @param[out] freed_pages  pages released (may be NULL)
 * @return KVDEPOT_OK; KVDEPOT_ENOTFOUND; transport errors.
 */
int kvdepot_sequence_delete(kvdepot_client *client, const void *id, size_t id_len,
                            uint64_t *freed_pages);

/* Arguments of kvdepot_sequence_append. Zero-initialise, then set. */
typedef struct kvdepot_append_args {
    const void *id;            /* sequence id */
    size_t id_len;
    uint32_t layer_start;      /* first layer */
    uint32_t num_layers;       /* 0 = all layers from layer_start */
    uint64_t token_start;      /* must equal the stored token count of each layer */
    uint64_t num_tokens;       /* tokens appended to each layer */
    kvdepot_dtype dtype;       /* must equal the model's dtype */
    /* K and V for [layer_start, +num_layers) × [token_start, +num_tokens),
     * each in the wire layout. Separate pointers: they need not be adjacent.
     * Only read during the call. */
    const void *k;
    size_t k_bytes;
    const void *v;
    size_t v_bytes;
    /* Optional token ids of the appended tokens (num_tokens of them), so the
     * server can hash the blocks this append completes. */
    const uint32_t *token_ids;
    size_t num_token_ids;
    /* Optional engine-supplied hashes of the blocks whose last token is in
     * this append, in order (overrides token_ids hashing). */
    const uint64_t *block_hashes;
    size_t num_block_hashes;
    /* Optional activations (layer inputs) X of the appended tokens,
     * [layer][token][hidden_size] in the model dtype: x_bytes = num_layers x
     * num_tokens x hidden_size x dtype size. Non-NULL x sends them after K
     * and V (AppendHeader.with_activations). Only for a sequence created
     * with codecs.store_activations, and only while every token before
     * token_start on these layers has them: else KVDEPOT_EPRECOND and
     * nothing is stored. An append without x is accepted on such a
     * sequence, but the layers it extends then keep activations for their
     * earlier tokens only (activation_tokens stops growing). */
    const void *x;
    size_t x_bytes;
    /* Optional, instead of block_hashes: the engine's names of every
     * engine block whose last token is in this append, in order (num =
     * (token_start + num_tokens) / block_tokens - token_start /
     * block_tokens); the pages the append completes are registered under
     * the names of their last blocks. */
    kvdepot_engine_hashes engine_hashes;
    /* Optional: create the sequence in the same call when it does not
     * exist, as kvdepot_sequence_create would with these arguments (their
     * id is not read: the append's serves), so that storing a new object
     * takes one round trip. If the append then fails, the sequence it
     * created is deleted again before the call returns. When the sequence
     * exists, create->model must be its model (else KVDEPOT_EPRECOND) and
     * the append goes on as without create. */
    const kvdepot_create_args *create;
    /* Optional out: set to 1 when create made the sequence in this call,
     * 0 when it existed (or the call failed). */
    int *created;
} kvdepot_append_args;

/*
 * Append: stream K then V (then X, when args->x is set) to the server in
 * messages of chunk_bytes. All or nothing: on any failure the sequence is
 * left as it was.
 *
 * @param[in]  client
 * @param[in]  args
 * @param[out] out     the sequence after the append (may be NULL); clear it
 *                     with kvdepot_sequence_info_clear()
 * @return KVDEPOT_OK; KVDEPOT_EINVAL for wrong sizes (k_bytes/v_bytes not
 *         the size of the range), a dtype other than the model's, a layer
 *         range outside the model, token id or block hash counts that do not
 *         match; KVDEPOT_ENOTFOUND for an unknown sequence;
 *         KVDEPOT_EPRECOND when token_start is not the end of a layer, or
 *         for activations the sequence cannot take (see x above);
 *         KVDEPOT_ENOMEM for a server limit; transport errors.
 */
int kvdepot_sequence_append(kvdepot_client *client, const kvdepot_append_args *args,
                            kvdepot_sequence_info *out);

/* Arguments of kvdepot_sequence_read. Zero-initialise, then set. */
typedef struct kvdepot_read_args {
    const void *id;
    size_t id_len;
    uint32_t layer_start;
    uint32_t num_layers;       /* 0 = all layers from layer_start */
    uint64_t token_start;
    uint64_t num_tokens;       /* 0 = up to the sequence's num_tokens */
    /* Destination for K and V, each with room for `capacity` bytes; or both
     * NULL to have the library allocate them. */
    void *k;
    void *v;
    size_t capacity;
    /* Activation-first read (KVPR): the first activation_tokens tokens of
     * the range come as activations X ([layer][token][hidden_size], model
     * dtype) instead of K and V; K and V hold the remaining tokens only.
     * The tokens must have stored activations (KVDEPOT_ERANGE otherwise,
     * KVDEPOT_EPRECOND for a sequence storing none); pick the count with
     * kvdepot_plan_fetch. With caller buffers (k, v) x must be given too,
     * with room for x_capacity bytes. */
    uint64_t activation_tokens;
    void *x;
    size_t x_capacity;
} kvdepot_read_args;

/* What kvdepot_sequence_read returned (kvdepot.v1.ReadHeader + buffers). */
typedef struct kvdepot_read_result {
    uint32_t layer_start;
    uint32_t num_layers;
    uint64_t token_start;
    uint64_t num_tokens;
    uint32_t num_kv_heads;
    uint32_t head_dim;
    kvdepot_dtype dtype;
    size_t kv_bytes;           /* bytes of K, and of V */
    void *k;                   /* the caller's buffer, or the library's */
    void *v;
    /* When the library allocated: the single block holding K then V, to be
     * freed with kvdepot_free() (k == owned, v == owned + kv_bytes).
     * NULL when the caller supplied buffers. */
    void *owned;
    /* Activation-first reads: K and V above cover tokens [token_start +
     * activation_tokens, token_start + num_tokens); x holds X of the first
     * activation_tokens tokens, x_bytes of it ([layer][token][hidden_size]).
     * When the library allocated, x == owned + 2 * kv_bytes. */
    uint64_t activation_tokens;
    uint32_t hidden_size;
    size_t x_bytes;
    void *x;
} kvdepot_read_result;

/*
 * Read: fetch K and V of a layer range × token range, bit-exact as appended.
 *
 * @param[in]  client
 * @param[in]  args
 * @param[out] out     header and buffers. On failure everything is zero and
 *                     nothing is allocated, except that on KVDEPOT_EINVAL for
 *                     a too small capacity the header fields and kv_bytes are
 *                     set, so the caller can retry with larger buffers.
 * @return KVDEPOT_OK; KVDEPOT_ENOTFOUND for an unknown sequence;
 *         KVDEPOT_ERANGE for tokens past the stored ones; KVDEPOT_EINVAL for
 *         a layer range outside the model, or capacity too small (caller's
 *         buffers may have been partly written); KVDEPOT_ECORRUPT when the
 *         server found a damaged page; KVDEPOT_EINTERNAL when the server's
 *         stream is malformed; KVDEPOT_ENOMEM; for activation_tokens:
 *         KVDEPOT_EINVAL (more than the range, or caller buffers without
 *         x), KVDEPOT_EPRECOND (sequence stores none), KVDEPOT_ERANGE
 *         (tokens without stored activations); transport errors.
 */
int kvdepot_sequence_read(kvdepot_client *client, const kvdepot_read_args *args,
                          kvdepot_read_result *out);

/* ------------------------------------------------------------------------ */
/* Non-blocking transfers                                                    */
/* ------------------------------------------------------------------------ */

/*
 * An engine overlaps moving layer l's cache with computing layer l + 1:
 * kvdepot_append_start / kvdepot_read_start begin an append or a read (as
 * kvdepot_sequence_append / kvdepot_sequence_read) and return at once with
 * a transfer to poll or wait on, or a callback. Transfers run on a pool of
 * threads the library keeps for the process (up to 8, see
 * kvdepot_transfer_threads; created as transfers wait, idle ones sleep);
 * each is its own gRPC call, so many in flight share the client's
 * connection. Appends of different layers of one sequence may be in flight
 * together (each layer's token_start is checked on its own); appends of
 * the same layers must be started after the earlier one completed.
 *
 * The args, and every buffer they point to (K, V, X, ids, hashes, the read
 * result and its buffers), must stay valid and unchanged until the
 * transfer completed; the client must not be closed before then.
 */
typedef struct kvdepot_transfer kvdepot_transfer;

/* Called on a pool thread when a transfer completed, with its status,
 * before kvdepot_transfer_poll says so. It must not wait on transfers or
 * free t (kvdepot_transfer_wait still must be called). */
typedef void (*kvdepot_transfer_fn)(void *arg, kvdepot_transfer *t, int status);

/*
 * Start an append.
 * @param[in]  done, arg  optional completion callback
 * @param[out] out        the transfer: wait on it exactly once
 * @return KVDEPOT_OK (its own status comes from kvdepot_transfer_wait);
 *         KVDEPOT_EINVAL for NULL arguments; KVDEPOT_ENOMEM.
 */
int kvdepot_append_start(kvdepot_client *client, const kvdepot_append_args *args,
                         kvdepot_transfer_fn done, void *arg, kvdepot_transfer **out);

/* Start a read into *result (as kvdepot_sequence_read fills it). */
int kvdepot_read_start(kvdepot_client *client, const kvdepot_read_args *args,
                       kvdepot_read_result *result, kvdepot_transfer_fn done, void *arg,
                       kvdepot_transfer **out);

/* 1 once the transfer completed (kvdepot_transfer_wait then returns at
 * once), else 0. */
int kvdepot_transfer_poll(const kvdepot_transfer *t);

/*
 * Wait until the transfer completed, free it, and return its status (its
 * message in kvdepot_errmsg on this thread).
 * @param[out] info  an append's sequence info as its commit left it (appends
 *                   of other layers in flight may land after it; may be
 *                   NULL); clear it with kvdepot_sequence_info_clear().
 *                   Zeroed for reads.
 */
int kvdepot_transfer_wait(kvdepot_transfer *t, kvdepot_sequence_info *info);

/* Most threads the transfer pool runs (1..256, default 8). */
int kvdepot_transfer_threads(unsigned n);

/* ------------------------------------------------------------------------ */
/* Prefix sharing                                                            */
/* ------------------------------------------------------------------------ */

/*
 * The documented block hash: xxh3-64 over the token ids as little-endian
 * uint32, seeded with the parent block's hash (0 for the first block).
 * @param[in] parent     hash of the previous block, 0 for the first
 * @param[in] token_ids  the block's token ids (page_tokens of them)
 * @param[in] n          number of token ids
 * @return the block hash.
 */
uint64_t kvdepot_prefix_hash(uint64_t parent, const uint32_t *token_ids, size_t n);

/*
 * Hash chain of every complete block of a token sequence.
 * @param[in]  token_ids    n token ids
 * @param[in]  n
 * @param[in]  page_tokens  tokens per block (the server's page_tokens, 256)
 * @param[out] out          room for n / page_tokens hashes (may be NULL to
 *                          only count)
 * @return the number of complete blocks, n / page_tokens (0 if page_tokens is 0).
 */
size_t kvdepot_prefix_hash_chain(const uint32_t *token_ids, size_t n, size_t page_tokens,
                                 uint64_t *out);

/*
 * Lookup: how many leading blocks of a hash chain the server stores for a
 * model.
 * @param[in]  client
 * @param[in]  model
 * @param[in]  hashes          the chain, n entries
 * @param[in]  n
 * @param[out] matched_blocks  (may be NULL)
 * @param[out] matched_tokens  (may be NULL)
 * @return KVDEPOT_OK; KVDEPOT_ENOTFOUND for an unknown model; transport errors.
 */
int kvdepot_prefix_lookup(kvdepot_client *client, const char *model, const uint64_t *hashes,
                          size_t n, uint64_t *matched_blocks, uint64_t *matched_tokens);

/*
 * Lookup by engine block hashes (a chain from block 0): how many leading
 * engine blocks the server stores for the model, in whole pages.
 * @param[out] matched_blocks  engine blocks (may be NULL)
 * @param[out] matched_tokens  (may be NULL)
 * @return as kvdepot_prefix_lookup; KVDEPOT_EINVAL for a block size not
 *         dividing the server's page size or a name of 0 or > 64 bytes.
 */
int kvdepot_engine_lookup(kvdepot_client *client, const char *model,
                          const kvdepot_engine_hashes *hashes, uint64_t *matched_blocks,
                          uint64_t *matched_tokens);

/* ------------------------------------------------------------------------ */
/* Several servers                                                           */
/* ------------------------------------------------------------------------ */

/*
 * kvdepot_connect accepts several endpoints in kvdepot_options.address,
 * separated by commas:
 *
 *     "10.0.0.5:50051,10.0.0.6:50051,10.0.0.7:50051"
 *     "shards:kvdepot-headless.kvdepot.svc.cluster.local:50051"
 *
 * Each entry is a gRPC target, or shards:HOST:PORT, which stands for every
 * address HOST resolves to (getaddrinfo; looked up again every
 * resolve_interval_ms and soon after a server fails; each address is an
 * endpoint named "IP:PORT"). The client then spreads keys over the servers
 * with rendezvous (highest-random-weight) hashing: every endpoint scores a
 * key as xxh3-64 of the key seeded with xxh3-64 of the endpoint name, and
 * the highest score owns it. Every client given the same endpoints agrees
 * on the owners; adding a server moves only the keys it now owns (about
 * 1/N), removing one moves only its keys.
 *
 *   - Sequences (create, append, read, stat, delete, evict) go to the owner of the
 *     sequence id. When the id holds a non-empty "{tag}", only the tag is
 *     hashed, so ids with equal tags share a server.
 *   - kvdepot_prefix_lookup goes to the owner of the chain's first block
 *     hash written as 16 lowercase hex digits. A sequence that should start
 *     from a prefix must live on that server: give it an id tagged
 *     "{<16 hex digits of the first block hash>}" (see
 *     kvdepot_shard_prefix_tag).
 *   - Model put and delete go to every server; get asks the servers in turn
 *     until one answers; list and kvdepot_sequence_list merge every
 *     server's answer. A sequence created on a server that does not know
 *     its model yet (one added later) gets the model copied from another.
 *   - Health is SERVING only when every server answers SERVING.
 *   - kvdepot_search, kvdepot_sparse_attend, kvdepot_plan_fetch,
 *     kvdepot_sequence_read_pages and kvdepot_append_pages go to the owner
 *     of the sequence. kvdepot_attend splits its batch by owner, runs each
 *     server's share as one call (the shares in parallel) and returns the
 *     results in query order; one share failing fails the call.
 *   - kvdepot_artifacts_upload goes to every server, kvdepot_artifacts_get
 *     to any; kvdepot_calibrate trains on one server (the first reachable
 *     in the model name's rendezvous order) and copies the artifacts it
 *     stored to every other reachable server.
 *
 * An unreachable server (no connection within connect_timeout_ms, or an
 * UNAVAILABLE answer) is retried shard_retries times with backoff, then
 * skipped for a growing time (see shard_backoff_ms). For its keys:
 * kvdepot_sequence_read, kvdepot_sequence_stat, kvdepot_sequence_evict and
 * the compute calls above (an Attend batch touching it as a whole)
 * answer KVDEPOT_ENOTFOUND (a cache miss, the message names the server);
 * kvdepot_prefix_lookup answers KVDEPOT_OK with 0 blocks matched; create,
 * append and delete answer KVDEPOT_EUNAVAIL (nothing was written).
 * Broadcasts skip it. No call waits on it longer than its bounded retries.
 * wait_for_ready is not used over several servers.
 *
 * A server that accepts the connection but stops answering holds a call
 * until its deadline (deadline_ms), as with one server.
 *
 * kvdepot_stats_get answers KVDEPOT_EUNSUPP on a client over several
 * servers (ask each server).
 *
 * With a single endpoint (no comma, no shards:) the client is the plain
 * one-server client and these functions describe that one server.
 */

/*
 * Number of servers the client spreads keys over right now (1 for a
 * single-server client; 0 when a shards: name resolved to nothing yet).
 */
size_t kvdepot_shard_count(kvdepot_client *client);

/*
 * Name of server `index` (0 .. kvdepot_shard_count()-1): the target as
 * given, or "IP:PORT" for addresses found behind a shards: name.
 * @param[in]  client
 * @param[in]  index
 * @param[out] buf, cap  room for the NUL-terminated name (256 bytes suffice)
 * @return KVDEPOT_OK; KVDEPOT_ERANGE for an index past the end;
 *         KVDEPOT_EINVAL for a NULL client or buffer or a too small cap.
 */
int kvdepot_shard_endpoint(kvdepot_client *client, size_t index, char *buf, size_t cap);

/*
 * Name of the server that owns a sequence id (or any key: pass the tag of
 * a prefix chain to find where it lives). Computed locally, no RPC.
 * @param[in]  client
 * @param[in]  id, id_len  the key
 * @param[out] buf, cap    room for the name
 * @return KVDEPOT_OK; KVDEPOT_EUNAVAIL when there is no server;
 *         KVDEPOT_EINVAL for NULL arguments or a too small cap.
 */
int kvdepot_shard_owner(kvdepot_client *client, const void *id, size_t id_len, char *buf,
                        size_t cap);

/*
 * Write the hash tag "{xxxxxxxxxxxxxxxx}" (first_block_hash as 16 lowercase
 * hex digits in braces, NUL-terminated) to buf, which needs 19 bytes. Ids
 * that contain it live where kvdepot_prefix_lookup looks for chains
 * starting with that block.
 * @return KVDEPOT_OK; KVDEPOT_EINVAL when buf is NULL or cap < 19.
 */
int kvdepot_shard_prefix_tag(uint64_t first_block_hash, char *buf, size_t cap);

/*
 * Resolve shards: names again now instead of waiting for the timer.
 * @return KVDEPOT_OK (also for clients without shards: names);
 *         KVDEPOT_EINVAL for a NULL client.
 */
int kvdepot_shard_refresh(kvdepot_client *client);

/* ------------------------------------------------------------------------ */
/* Compute on stored caches                                                  */
/* ------------------------------------------------------------------------ */

/*
 * Decode attention is computed per query head h, with grouped-query
 * attention (query head h reads kv head h / (num_q_heads / num_kv_heads)):
 *
 *     s_t   = scale * q_h . k_t
 *     lse_h = ln sum_t exp(s_t)
 *     out_h = sum_t exp(s_t - lse_h) v_t
 *
 * Results over disjoint token ranges combine exactly with
 * kvdepot_attention_merge(), so an engine can ask the server for the stored
 * tokens and add the tokens it still holds itself.
 */

/* One (sequence, query) pair of kvdepot_attend. */
typedef struct kvdepot_attend_query {
    const void *id;
    size_t id_len;
    const float *q;        /* (num_q_heads, head_dim) f32, row-major */
    size_t q_len;          /* floats in q: num_q_heads * head_dim of the model */
    uint64_t token_start;
    uint64_t num_tokens;   /* 0 = to the end of the layer */
} kvdepot_attend_query;

/* The answer to one query. */
typedef struct kvdepot_attend_result {
    float *output;         /* (num_q_heads, head_dim) f32; free with
                              kvdepot_attend_results_free */
    float *lse;            /* (num_q_heads) f32; -inf for an empty range */
    size_t num_q_heads;
    size_t head_dim;
    uint64_t num_tokens;   /* tokens attended */
} kvdepot_attend_result;

/*
 * Attend (kvdepot.v1 Attend): attention of each query over its sequence's
 * stored tokens [token_start, token_start + num_tokens) at `layer`, computed
 * by the server on the pages it holds. The whole batch is checked before
 * anything is computed; one bad query fails the call.
 * @param[in]  client
 * @param[in]  layer    model layer
 * @param[in]  scale    softmax scale; 0 = 1/sqrt(head_dim)
 * @param[in]  queries  n pairs (1..1024); sequences may belong to different
 *                      models
 * @param[out] out      n results, filled in order; free the buffers with
 *                      kvdepot_attend_results_free(out, n)
 * @return KVDEPOT_OK; KVDEPOT_EINVAL (bad layer, q of the wrong size, empty
 *         or oversized batch); KVDEPOT_ENOTFOUND (unknown sequence);
 *         KVDEPOT_ERANGE (tokens past those stored); KVDEPOT_ECORRUPT (a
 *         page failed its checksum); KVDEPOT_ENOMEM (the batch or its
 *         answer does not fit in one message: the message names the limit
 *         and how many such queries fit).
 */
int kvdepot_attend(kvdepot_client *client, uint32_t layer, float scale,
                   const kvdepot_attend_query *queries, size_t n, kvdepot_attend_result *out);

/*
 * kvdepot_attend with queries of `q_dtype`: KVDEPOT_DTYPE_F16 or _BF16 (each
 * query's q then points to q_len 16-bit values of that type: cast it) go
 * as they are, and the outputs come back in the same dtype on the wire
 * (returned as f32 all the same, LSE in f32): half the bytes each way, so
 * about twice as many queries fit in one message. KVDEPOT_DTYPE_F32 (or
 * UNSPECIFIED) is kvdepot_attend.
 */
int kvdepot_attend_dtype(kvdepot_client *client, uint32_t layer, float scale, kvdepot_dtype q_dtype,
                         const kvdepot_attend_query *queries, size_t n, kvdepot_attend_result *out);

/* Free the buffers of n results (the array itself is the caller's); NULL is
 * a no-op. */
void kvdepot_attend_results_free(kvdepot_attend_result *results, size_t n);

/*
 * Local attention with the same CPU kernels the server uses, on K/V in the
 * wire layout of one layer: k and v each [token][kv_head][head_dim] in
 * `dtype`, num_tokens tokens (0 allowed: lse = -inf, out = 0).
 * @param[in]  q    (num_q_heads, head_dim) f32
 * @param[out] out  (num_q_heads, head_dim) f32
 * @param[out] lse  (num_q_heads) f32
 * @return KVDEPOT_OK; KVDEPOT_EINVAL for bad shapes (num_q_heads not a
 *         multiple of num_kv_heads, NULL buffers); KVDEPOT_ENOMEM.
 */
int kvdepot_attention_local(kvdepot_dtype dtype, uint32_t num_q_heads, uint32_t num_kv_heads,
                            uint32_t head_dim, float scale, const float *q, const void *k,
                            const void *v, uint64_t num_tokens, float *out, float *lse);

/*
 * Merge two results over disjoint token sets into (out_a, lse_a):
 *   lse = ln(e^lse_a + e^lse_b), out = e^(lse_a-lse) out_a + e^(lse_b-lse) out_b.
 * A side with lse = -inf contributes nothing.
 * @return KVDEPOT_OK; KVDEPOT_EINVAL for NULL buffers.
 */
int kvdepot_attention_merge(uint32_t num_q_heads, uint32_t head_dim, float *out_a, float *lse_a,
                            const float *out_b, const float *lse_b);

/* kvdepot_plan_fetch's answer (kvdepot.v1.PlanFetchResponse). */
typedef struct kvdepot_fetch_plan {
    uint64_t split_tokens;        /* l: send activations for tokens [0, l) */
    uint64_t num_tokens;          /* n */
    double predicted_seconds;     /* t(l) */
    double kv_only_seconds;       /* t(0): a plain fetch */
    double recompute_seconds;     /* t_rc(l) */
    uint64_t activation_bytes;    /* M_X(l) */
    uint64_t kv_bytes;            /* M_KV(l) */
    double kv_bytes_per_token;    /* the terms of the cost model */
    double activation_bytes_per_token;
    double flops_per_token;
} kvdepot_fetch_plan;

/*
 * PlanFetch (KVPR): where to split a fetch of a sequence so the receiver
 * recomputes K/V of the first l tokens from activations while the rest
 * streams in. Cost model (kvdepot.proto, PlanFetchRequest):
 *   t(l) = l*x/bw + max(l*f/rate, (n - l)*kv/bw)
 * with x, kv, f the per-token activation bytes, stored K/V bytes and
 * recompute flops over the layers asked for; l ranges over [0, n] when
 * assume_activations is set, else over [0, a] with a the sequence's
 * activation_tokens (tokens whose activations the server stores, 0 for a
 * sequence without store_activations); l = 0 for a model without a
 * hidden_size. Read the split with kvdepot_read_args.activation_tokens = l.
 * @param[in]  bandwidth_bytes_per_s, compute_flops_per_s  both > 0
 * @param[in]  layer_start, num_layers  layers fetched (num_layers 0 = all
 *             from layer_start)
 * @param[out] out
 * @return KVDEPOT_OK; KVDEPOT_EINVAL; KVDEPOT_ENOTFOUND.
 */
int kvdepot_plan_fetch(kvdepot_client *client, const void *id, size_t id_len,
                       double bandwidth_bytes_per_s, double compute_flops_per_s,
                       uint32_t layer_start, uint32_t num_layers, int assume_activations,
                       kvdepot_fetch_plan *out);

/* ---- tiers ---------------------------------------------------------------- */

/* One tier of a server: device (GPU pool, or host memory on a CPU server),
 * host memory, disk (RocksDB). */
typedef struct kvdepot_tier_stats {
    char name[16];        /* "device", "host", "disk" */
    uint64_t limit_bytes; /* 0: off (memory tiers) or unlimited (disk) */
    uint64_t bytes;       /* page bytes held now */
    uint64_t pages;
    uint64_t hits;        /* page reads served by it (disk: misses of the memory tiers) */
    uint64_t evictions;   /* pages moved out (disk: sequences dropped) */
} kvdepot_tier_stats;

typedef struct kvdepot_stats {
    char durability[8];   /* "none", "spill", "sync" */
    kvdepot_tier_stats tiers[3]; /* device, host, disk */
    size_t num_tiers;
    uint64_t misses, promotions, prefetched;
    uint64_t checksum_failures;  /* pages (and activation records) refused as DATA_LOSS */
    uint64_t sequences_dropped;  /* by the disk limit under durability none */
    uint64_t sequences_expired;  /* by their TTL */
    uint64_t sequences;
    char backend[16];         /* where the device tier is held and attended: "cuda" or "cpu" */
    uint32_t backend_threads; /* threads of its CPU ops */
    char device[128];         /* the GPU's name; "" on the CPU */
    uint64_t device_memory_bytes;   /* its memory; 0 on the CPU */
    int device_healthy;             /* 0 once a device error left it unusable */
    uint64_t device_pages_attended; /* pages Attend read where they lie on the GPU */
    uint64_t device_pages_searched; /* pages whose PQ codes Search read on the GPU */
    uint64_t device_pages_encoded;  /* pages an Append coded on the GPU */
    uint64_t device_fallbacks;      /* GPU work failed (lost, out of memory), redone on the CPU */
    uint64_t device_pages_placed;   /* pages an Append coded on the GPU and put in its tier
                                     * where they were coded (not copied up again) */
    /* The server's memory by part, now (0 for a tenant's token): */
    uint64_t mem_rss_bytes;         /* its resident set */
    uint64_t mem_appends_bytes;     /* what calls in flight hold (append-memory-bytes) */
    uint64_t mem_memtables_bytes;   /* RocksDB's memtables */
    uint64_t mem_block_cache_bytes; /* RocksDB's block cache */
} kvdepot_stats;

/**
 * Stats: the server's tiers and counters.
 * @param[out] out  filled on success
 * @return KVDEPOT_OK; KVDEPOT_EINVAL; KVDEPOT_EUNSUPP on a client over
 *         several servers (ask each server).
 */
int kvdepot_stats_get(kvdepot_client *client, kvdepot_stats *out);

/* What a backup wrote (kvdepot.v1.BackupResponse). */
typedef struct kvdepot_backup_info {
    uint64_t files, bytes, duration_ms;
} kvdepot_backup_info;

/**
 * Backup: a consistent copy of the server's whole store, as of one
 * instant, in `dir` on the server's host (absolute; must not exist, its
 * parent must), taken while the server serves. Needs an admin token when
 * the server has a tokens file. Restore: `kvdepotd restore DIR --data-dir
 * NEW`, or start kvdepotd with --data-dir DIR.
 * @param[out] out  files and bytes written (may be NULL)
 * @return KVDEPOT_OK; KVDEPOT_EINVAL (relative path); KVDEPOT_EEXIST;
 *         KVDEPOT_EPRECOND (no parent directory); KVDEPOT_EPERM;
 *         KVDEPOT_EUNSUPP on a client over several servers.
 */
int kvdepot_backup(kvdepot_client *client, const char *dir, kvdepot_backup_info *out);

/**
 * EvictSequence: move a sequence's pages out of the server's memory tiers
 * (it stays stored; a later read promotes them again).
 * @param[out] pages, bytes  what left memory (either may be NULL)
 * @return KVDEPOT_OK; KVDEPOT_ENOTFOUND; KVDEPOT_EINVAL.
 */
int kvdepot_sequence_evict(kvdepot_client *client, const void *id, size_t id_len,
                           uint64_t *pages, uint64_t *bytes);

/* Arguments of kvdepot_search and kvdepot_sparse_attend. */
typedef struct kvdepot_search_args {
    const void *id;
    size_t id_len;
    uint32_t layer;
    const float *q;            /* (num_q_heads, head_dim) f32 */
    size_t q_len;              /* floats in q */
    uint32_t k;                /* best tokens per kv head, besides the forced ones */
    uint32_t initial_tokens;   /* first tokens of the range always returned */
    uint32_t recent_tokens;    /* last tokens of the range always returned */
    uint64_t token_start;
    uint64_t num_tokens;       /* 0 = to the end of the layer */
} kvdepot_search_args;

/* Tokens chosen for one kv head. */
typedef struct kvdepot_head_tokens {
    uint32_t kv_head;
    size_t count;
    uint64_t *tokens;          /* absolute positions, best first */
    float *scores;             /* approximate q.k, summed over the GQA group */
} kvdepot_head_tokens;

/* kvdepot_search's answer; free with kvdepot_search_result_free. */
typedef struct kvdepot_search_result {
    size_t num_heads;
    kvdepot_head_tokens *heads;
} kvdepot_search_result;

/*
 * Search (PQCache): top-k tokens per kv head by the PQ index of a sequence
 * created with codecs.pq_m > 0. For each kv head the queries of its GQA
 * group are summed; the index covers the token range asked for (centroids
 * trained on its first 4096 keys, see kvdepot.proto SearchRequest). The
 * first initial_tokens and last recent_tokens are returned besides the k
 * best of the others; entries are ordered by score, best first.
 * @return KVDEPOT_OK; KVDEPOT_EINVAL (q size, k larger than the range,
 *         layer); KVDEPOT_EPRECOND (no PQ index); KVDEPOT_ENOTFOUND;
 *         KVDEPOT_ERANGE.
 */
int kvdepot_search(kvdepot_client *client, const kvdepot_search_args *args,
                   kvdepot_search_result *out);

/* Free what kvdepot_search or kvdepot_sparse_attend returned; NULL is a no-op. */
void kvdepot_search_result_free(kvdepot_search_result *r);

/*
 * SparseAttend: kvdepot_search, then attention of every query head over the
 * tokens chosen for its kv head, in one call. *tokens (may be NULL) receives
 * the search result.
 * @param[in]  scale  softmax scale; 0 = 1/sqrt(head_dim)
 * @param[out] out    output and LSE over the chosen tokens; free with
 *                    kvdepot_attend_results_free(out, 1)
 * @return as kvdepot_search.
 */
int kvdepot_sparse_attend(kvdepot_client *client, const kvdepot_search_args *args, float scale,
                          kvdepot_attend_result *out, kvdepot_search_result *tokens);

/* The PQ centroids of one layer of a sequence (kvdepot.proto GetPQCentroids):
 * data (num_kv_heads, m, 2^bits, head_dim / m) f32, count floats; centroid
 * c of sub-space j of kv head h covers dimensions [j * head_dim / m,
 * (j + 1) * head_dim / m) of that head's keys. centroids_id is the id the
 * pages' PQ sections carry. Free with kvdepot_pq_centroids_free. */
typedef struct kvdepot_pq_centroids {
    uint32_t layer, num_kv_heads, head_dim, m, bits;
    uint64_t centroids_id;
    float *data;
    size_t count;
} kvdepot_pq_centroids;

/*
 * GetPQCentroids: the stored centroids of `layer` of a sequence created with
 * codecs.pq_m > 0, the ones Search scores with; with the pages
 * (kvdepot_read_pages) a client reproduces every Search answer.
 * @return KVDEPOT_OK; KVDEPOT_EPRECOND (no PQ index, or no page of the layer
 *         sealed yet); KVDEPOT_EINVAL (layer); KVDEPOT_ENOTFOUND.
 */
int kvdepot_pq_centroids_get(kvdepot_client *client, const void *id, size_t id_len, uint32_t layer,
                             kvdepot_pq_centroids *out);

/* Free what kvdepot_pq_centroids_get returned; NULL is a no-op. */
void kvdepot_pq_centroids_free(kvdepot_pq_centroids *c);

/*
 * RebuildPQIndex: train the PQ centroids of layers [layer_start,
 * layer_start + num_layers) (num_layers 0 = to the last) again on keys
 * spread over the whole sequence (4096 of them, evenly), and code every
 * sealed page of the sequence's own under them; for a long sequence whose
 * keys drifted from its first tokens', or one shorter than
 * pq_min_train_tokens (never trained). Appends and reads go on meanwhile
 * (KVDEPOT_EABORTED, nothing changed, if an append trained a layer of the
 * range: call again). *layers_rebuilt, *tokens_indexed (summed over layers) and *info
 * (the sequence after; clear with kvdepot_sequence_info_clear) may be NULL.
 * KVDEPOT_EPRECOND without a PQ index; KVDEPOT_ENOMEM when the larger index
 * exceeds the tenant's byte quota or the disk limit (nothing changed).
 */
int kvdepot_pq_rebuild(kvdepot_client *client, const void *id, size_t id_len, uint32_t layer_start,
                       uint32_t num_layers, uint32_t *layers_rebuilt, uint64_t *tokens_indexed,
                       kvdepot_sequence_info *info);

/* One encoded page (docs/page-format.md): the bytes that cross the network. */
typedef struct kvdepot_page {
    void *data;
    size_t len;
} kvdepot_page;

/*
 * Client-side encoding: K and V of `num_tokens` tokens of one layer (wire
 * layout, [token][kv_head][head_dim] in model->dtype, tokens [token_start,
 * token_start + num_tokens)) into pages of page_tokens tokens (the server's
 * page size, SequenceInfo.page_tokens): every page that holds its whole
 * block is encoded with `codecs` (NULL = raw; blocks before raw_sink_tokens
 * stay raw), a partial page at either end stays raw. The encoder is the
 * server's own (same CPU kernels, same bytes for the same spec). VQ and
 * SVD codecs need the model's artifacts: use
 * kvdepot_encode_pages_with_artifacts (here they fail with KVDEPOT_EINVAL).
 * @param[out] pages, count  malloc'd array; free with kvdepot_pages_free
 * @return KVDEPOT_OK; KVDEPOT_EINVAL (shape, spec the model cannot take);
 *         KVDEPOT_ENOMEM.
 */
int kvdepot_encode_pages(const kvdepot_model *model, const kvdepot_codecs *codecs,
                         uint32_t page_tokens, uint32_t layer, uint64_t token_start,
                         uint64_t num_tokens, const void *k, const void *v, kvdepot_page **pages,
                         size_t *count);

/*
 * kvdepot_encode_pages for codecs that need model artifacts (VQ, SVD): the
 * caller passes the model's artifacts (kvdepot_artifacts_get; those of
 * every layer, or at least of layers 0..num_layers-1 for the kinds the
 * codecs use). Pages carry the fingerprint of the artifacts they were coded
 * with; the server's AppendPages accepts them only when it equals the
 * fingerprint of the snapshot the sequence took at kvdepot_sequence_create
 * (KVDEPOT_EPRECOND otherwise, e.g. after a recalibration). With no VQ/SVD
 * in `codecs` the artifacts are ignored.
 * @return as kvdepot_encode_pages; KVDEPOT_EINVAL also names a missing or
 *         mis-shaped artifact.
 */
struct kvdepot_artifact;
int kvdepot_encode_pages_with_artifacts(const kvdepot_model *model, const kvdepot_codecs *codecs,
                                        const struct kvdepot_artifact *artifacts,
                                        size_t n_artifacts,
                                        uint32_t page_tokens, uint32_t layer,
                                        uint64_t token_start, uint64_t num_tokens, const void *k,
                                        const void *v, kvdepot_page **pages, size_t *count);

/* Free pages made by kvdepot_encode_pages or kvdepot_sequence_read_pages;
 * NULL is a no-op. */
void kvdepot_pages_free(kvdepot_page *pages, size_t count);

/*
 * Read in page format: the stored pages of a layer range x token range as
 * the server keeps them (encoded, checksummed; docs/page-format.md), in
 * (layer, token) order, every page holding a token of the range (whole
 * blocks at both ends; the raw tail as one page). args->k, v and capacity
 * are ignored. The pages can be checked and decoded with the page format,
 * or sent to another server with kvdepot_append_pages.
 * @param[out] pages, count  malloc'd array (NULL, 0 for an empty range or
 *                           on failure); free with kvdepot_pages_free
 * @return KVDEPOT_OK; KVDEPOT_ENOTFOUND; KVDEPOT_ERANGE for tokens past the
 *         stored ones; KVDEPOT_EINVAL (NULL argument, layer range);
 *         KVDEPOT_ECORRUPT (a damaged page on the server); KVDEPOT_EINTERNAL
 *         (malformed stream); KVDEPOT_ENOMEM; transport errors.
 */
int kvdepot_sequence_read_pages(kvdepot_client *client, const kvdepot_read_args *args,
                                kvdepot_page **pages, size_t *count);

/*
 * AppendPages: store pages the client encoded, so only compressed bytes
 * cross the network. The pages of every layer must continue the layer at
 * its stored token count and cover the same tokens on contiguous layers;
 * sealed pages carry the sequence's codecs. All or nothing.
 * @param[out] out  the sequence after the append (may be NULL); clear with
 *                  kvdepot_sequence_info_clear()
 * @return KVDEPOT_OK; KVDEPOT_ECORRUPT (a page failed its checksum or its
 *         coded sections are malformed); KVDEPOT_EINVAL (shape, codecs,
 *         tiling); KVDEPOT_EPRECOND (not at the layer's end);
 *         KVDEPOT_ENOTFOUND; KVDEPOT_ENOMEM (max-append-bytes, or the
 *         server's append-memory-bytes with the calls in flight: retry).
 */
int kvdepot_append_pages(kvdepot_client *client, const void *id, size_t id_len,
                         const kvdepot_page *pages, size_t count, kvdepot_sequence_info *out);

/* Arguments of kvdepot_sequence_append_pages. Zero-initialise, then set. */
typedef struct kvdepot_append_pages_args {
    const void *id;
    size_t id_len;
    const kvdepot_page *pages;
    size_t count;
    /* Optional: create the sequence in the same call when it does not
     * exist, as in kvdepot_append_args (its id is not read), so that a new
     * object of pages encoded here is stored in one round trip; if the
     * pages are refused, the sequence is deleted again before the call
     * returns. When it exists, create->model must be its model (else
     * KVDEPOT_EPRECOND). */
    const kvdepot_create_args *create;
    /* Optional out: 1 when create made the sequence in this call, 0 when it
     * existed (or the call failed). */
    int *created;
} kvdepot_append_pages_args;

/* kvdepot_append_pages with its arguments in a struct, and create. The same
 * returns, and those of kvdepot_sequence_create for args->create. */
int kvdepot_sequence_append_pages(kvdepot_client *client, const kvdepot_append_pages_args *args,
                                  kvdepot_sequence_info *out);

/* ---- model artifacts ------------------------------------------------------ */

/* What an artifact holds; values equal kvdepot.v1.ArtifactKind. Every
 * artifact is one f32 array for one (layer, kv head). */
typedef enum kvdepot_artifact_kind {
    KVDEPOT_ARTIFACT_KEY_SMOOTHING = 1,   /* (head_dim): key smoothing factors */
    KVDEPOT_ARTIFACT_VQ_CODEBOOK_K = 2,   /* (2^b, d): keys after smoothing + Hadamard */
    KVDEPOT_ARTIFACT_VQ_CODEBOOK_V = 3,   /* (2^b, d) */
    KVDEPOT_ARTIFACT_SVD_ROTATION_K = 4,  /* (head_dim, head_dim), columns by decreasing
                                             singular value */
    KVDEPOT_ARTIFACT_SVD_ROTATION_V = 5,
    KVDEPOT_ARTIFACT_SVD_SPECTRUM_K = 6,  /* (head_dim), decreasing */
    KVDEPOT_ARTIFACT_SVD_SPECTRUM_V = 7,
} kvdepot_artifact_kind;

typedef struct kvdepot_artifact {
    int kind; /* kvdepot_artifact_kind */
    uint32_t layer;
    uint32_t kv_head;
    uint32_t ndim;     /* 1 or 2 */
    uint32_t shape[2]; /* shape[1] unused when ndim == 1 */
    float *data;       /* prod(shape) values, row-major */
} kvdepot_artifact;

/*
 * UploadArtifacts: store artifacts for `model`, replacing those of the same
 * (kind, layer, kv head). The server checks every one against the model
 * (layer and head in range, shapes as listed at kvdepot_artifact_kind,
 * finite values) before storing any: all or nothing. Artifacts are removed
 * with their model.
 * @param[in]  a, count  artifacts (the caller keeps ownership)
 * @param[out] stored    artifacts stored (may be NULL)
 * @return KVDEPOT_OK; KVDEPOT_EINVAL (a malformed artifact; nothing stored);
 *         KVDEPOT_ENOTFOUND (no such model); KVDEPOT_EPERM; KVDEPOT_ENOMEM
 *         (over max-append-bytes, or the server's append-memory-bytes with
 *         the calls in flight); KVDEPOT_EUNSUPP on a client over several
 *         servers.
 */
int kvdepot_artifacts_upload(kvdepot_client *client, const char *model,
                             const kvdepot_artifact *a, size_t count, uint32_t *stored);

/*
 * GetArtifacts: the stored artifacts of `model` whose kind is among
 * kinds[0..nkinds) (all when nkinds == 0; at most 16 kinds), ordered by
 * (kind, layer, kv head). The values are bit-exact copies of what was
 * stored.
 * @param[out] out, count  malloc'd array (NULL, 0 when none); free with
 *                         kvdepot_artifacts_free(). NULL, 0 on failure.
 * @return KVDEPOT_OK; KVDEPOT_EINVAL (unknown kind); KVDEPOT_ENOTFOUND;
 *         KVDEPOT_EPERM; KVDEPOT_ENOMEM.
 */
int kvdepot_artifacts_get(kvdepot_client *client, const char *model, const int *kinds,
                          size_t nkinds, kvdepot_artifact **out, size_t *count);

/* Free what kvdepot_artifacts_get returned; NULL is a no-op. */
void kvdepot_artifacts_free(kvdepot_artifact *a, size_t count);

/* What Calibrate trains (kvdepot.v1.CalibrateHeader). */
typedef struct kvdepot_calibrate_args {
    const char *model;
    uint32_t vq_sub_dim; /* VQ codebooks of (2^vq_bits, vq_sub_dim); both 0 = no VQ */
    uint32_t vq_bits;
    int svd;              /* nonzero: SVD rotations and spectra */
    uint32_t iterations;  /* K-means iterations; 0 = 10 */
    uint64_t seed;        /* sampling and K-means seed */
    uint64_t max_samples; /* tokens kept per layer (uniform reservoir); 0 = 65536 */
    /* Codec advice (kvdepot.v1.CalibrateHeader.error_budget): > 0 (at most
     * 1) evaluates every codec the server can store on the last quarter of
     * each layer's kept tokens (at most 1024; a layer needs 512 kept, and
     * every sample q), training the artifacts on the rest, and recommends
     * the K/V pair with the fewest bits whose attention-output error
     * ||o - o^||^2 / ||o||^2 stays within it (kvdepot_calibrate_result.advice). */
    double error_budget;
    uint32_t eval_queries; /* held-out queries per layer; 0 = 16, at most 256 */
    int exhaustive;        /* nonzero: also measure every K x V pair (slower) */
} kvdepot_calibrate_args;

/* One batch of samples of one layer, wire layout in the model dtype:
 * k and v [token][kv_head][head_dim], q (optional, NULL) [token][q_head][head_dim].
 * Within a layer either every sample carries q or none does. */
typedef struct kvdepot_calibrate_sample {
    uint32_t layer;
    uint64_t num_tokens;
    const void *k, *v, *q;
    size_t kv_bytes; /* bytes of k, and of v */
    size_t q_bytes;  /* bytes of q */
} kvdepot_calibrate_sample;

/* Relative reconstruction error ||x - x^||^2 / ||x||^2 of one (layer, kv
 * head) over its kept samples (0 where not computed). svd_* are the energy
 * share dropped at the kept widths of removal rate 0.01 (align 8). */
typedef struct kvdepot_calibration_error {
    uint32_t layer, kv_head;
    double vq_k, vq_v, svd_k, svd_v;
    uint32_t svd_width_k, svd_width_v;
} kvdepot_calibration_error;

/* One candidate codec of K or V on one layer, the other side exact
 * (kvdepot.v1.CodecEvaluation). */
typedef struct kvdepot_codec_eval {
    kvdepot_codec_spec codec;
    double bits_per_value;  /* as a sealed page stores it (codes and group parameters) */
    double attention_error; /* ||o - o^||^2 / ||o||^2 on the held-out queries */
} kvdepot_codec_eval;

/* kvdepot.v1.CodecLayerAdvice. */
typedef struct kvdepot_layer_advice {
    uint32_t layer;
    kvdepot_codec_eval *k, *v; /* every candidate */
    size_t n_k, n_v;
    /* the fewest-bits pair meeting the budget (measured with both coded) */
    kvdepot_codec_spec k_recommended, v_recommended;
    double bits_per_value, attention_error;
    /* exhaustive: the same among every pair */
    kvdepot_codec_spec k_best, v_best;
    double best_bits_per_value, best_attention_error;
} kvdepot_layer_advice;

/* kvdepot.v1.CodecAdvice: per layer, and one pair for the whole model
 * (k, v: ready for kvdepot_codecs of a new sequence). */
typedef struct kvdepot_codec_advice {
    double error_budget;
    uint32_t eval_tokens, eval_queries;
    kvdepot_layer_advice *layers;
    size_t n_layers;
    kvdepot_codec_spec k, v;
    double bits_per_value, max_attention_error;
} kvdepot_codec_advice;

typedef struct kvdepot_calibrate_result {
    uint64_t samples;    /* tokens received */
    uint32_t artifacts;  /* artifacts stored */
    kvdepot_calibration_error *errors; /* one per calibrated (layer, kv head) */
    size_t n_errors;
    kvdepot_codec_advice *advice; /* with error_budget > 0; NULL otherwise */
} kvdepot_calibrate_result;

/*
 * Calibrate: stream samples of `a->model`; the server computes, per (layer,
 * kv head) with samples, the key smoothing factors, VQ codebooks (when
 * vq_bits is set; head_dim must be a power of two) and SVD rotations and
 * spectra (when svd is set), and stores them as the model's artifacts
 * (replacing those of the same kind, layer and head; read them back with
 * kvdepot_artifacts_get). Nothing is stored on any error.
 * @param[out] out  counts and per-head errors (may be NULL); clear with
 *                  kvdepot_calibrate_result_clear()
 * @return KVDEPOT_OK; KVDEPOT_EINVAL (VQ spec, sample shape or layer,
 *         non-finite values, no samples); KVDEPOT_ENOTFOUND (model);
 *         KVDEPOT_EPERM; KVDEPOT_ENOMEM (sample memory over the server's
 *         limit: 4 x max-append-bytes a call, and append-memory-bytes with
 *         the calls in flight).
 */
int kvdepot_calibrate(kvdepot_client *client, const kvdepot_calibrate_args *a,
                      const kvdepot_calibrate_sample *samples, size_t count,
                      kvdepot_calibrate_result *out);

/* Free the errors and advice of a result and zero it; NULL is a no-op. */
void kvdepot_calibrate_result_clear(kvdepot_calibrate_result *r);

#ifdef __cplusplus
}
#endif

#endif /* KVDEPOT_H */
