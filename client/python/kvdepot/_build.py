"""The cffi builder of kvdepot._native.

API mode: the extension is compiled against kvdepot.h, so the compiler, not
this file, lays out every struct (the declarations below end in "...;" and
name only the members Python uses). Where to find the library:

  KVDEPOT_INCLUDE_DIR  directory of kvdepot.h (default: ../../include, the
                       repository's client/include)
  KVDEPOT_LIB_DIR      directory of libkvdepot.so (default: the system's);
                       it is also recorded as the extension's run path
"""
import os

from cffi import FFI

CDEF = r"""
typedef struct kvdepot_client kvdepot_client;
typedef enum kvdepot_dtype {
    KVDEPOT_DTYPE_UNSPECIFIED, KVDEPOT_DTYPE_F16, KVDEPOT_DTYPE_BF16, KVDEPOT_DTYPE_F32, ...
} kvdepot_dtype;
typedef enum kvdepot_serving {
    KVDEPOT_SERVING_UNKNOWN, KVDEPOT_SERVING, KVDEPOT_NOT_SERVING, KVDEPOT_SERVICE_UNKNOWN, ...
} kvdepot_serving;
#define KVDEPOT_NAME_MAX ...
#define KVDEPOT_ID_MAX ...

typedef struct kvdepot_options {
    const char *address;
    uint32_t deadline_ms;
    int wait_for_ready;
    int tls;
    const char *tls_ca_file;
    const char *tls_cert_file;
    const char *tls_key_file;
    const char *tls_server_name;
    const char *token;
    ...;
} kvdepot_options;

typedef struct kvdepot_model {
    char name[];
    char revision[];
    uint32_t num_layers;
    uint32_t num_kv_heads;
    uint32_t num_q_heads;
    uint32_t head_dim;
    uint32_t hidden_size;
    kvdepot_dtype dtype;
    uint64_t created_unix_ms;
    ...;
} kvdepot_model;

typedef enum kvdepot_codec {
    KVDEPOT_CODEC_RAW, KVDEPOT_CODEC_INT2, KVDEPOT_CODEC_INT4, KVDEPOT_CODEC_VQ, ...
} kvdepot_codec;
typedef enum kvdepot_quant_axis {
    KVDEPOT_AXIS_DEFAULT, KVDEPOT_AXIS_TOKEN, KVDEPOT_AXIS_CHANNEL, ...
} kvdepot_quant_axis;
typedef struct kvdepot_codec_spec {
    kvdepot_codec codec;
    uint32_t group_size;
    int stochastic;
    kvdepot_quant_axis axis;
    uint64_t seed;
    uint32_t vq_sub_dim, vq_bits;
    double svd_removal_rate;
    const uint32_t *svd_widths;
    size_t svd_num_widths;
    ...;
} kvdepot_codec_spec;
typedef struct kvdepot_codecs {
    kvdepot_codec_spec k;
    kvdepot_codec_spec v;
    uint32_t raw_sink_tokens;
    uint32_t pq_m;
    uint32_t pq_bits;
    uint32_t pq_iterations;
    uint32_t pq_min_train_tokens;
    ...;
} kvdepot_codecs;

typedef struct kvdepot_sequence_info {
    uint8_t id[];
    size_t id_len;
    char model[];
    uint64_t num_tokens;
    uint64_t *layer_tokens;
    size_t num_layers;
    uint32_t page_tokens;
    uint64_t sealed_pages;
    uint64_t stored_bytes;
    uint64_t created_unix_ms;
    uint64_t prefix_blocks;
    uint64_t activation_tokens;
    int have_codecs;
    kvdepot_codecs codecs;
    uint64_t artifacts_fingerprint;
    uint64_t pq_index_bytes;
    ...;
} kvdepot_sequence_info;

typedef struct kvdepot_engine_hashes {
    const uint8_t *bytes;
    size_t len;
    size_t num;
    uint32_t block_tokens;
} kvdepot_engine_hashes;

typedef struct kvdepot_create_args {
    const void *id;
    size_t id_len;
    const char *model;
    const uint64_t *prefix_hashes;
    size_t num_prefix_hashes;
    uint64_t ttl_seconds;
    const kvdepot_codecs *codecs;
    kvdepot_engine_hashes engine_prefix;
    ...;
} kvdepot_create_args;

typedef struct kvdepot_search_args {
    const void *id;
    size_t id_len;
    uint32_t layer;
    const float *q;
    size_t q_len;
    uint32_t k;
    uint32_t initial_tokens;
    uint32_t recent_tokens;
    uint64_t token_start;
    uint64_t num_tokens;
    ...;
} kvdepot_search_args;
typedef struct kvdepot_head_tokens {
    uint32_t kv_head;
    size_t count;
    uint64_t *tokens;
    float *scores;
    ...;
} kvdepot_head_tokens;
typedef struct kvdepot_search_result {
    size_t num_heads;
    kvdepot_head_tokens *heads;
    ...;
} kvdepot_search_result;
typedef struct kvdepot_fetch_plan {
    uint64_t split_tokens;
    uint64_t num_tokens;
    double predicted_seconds;
    double kv_only_seconds;
    double recompute_seconds;
    uint64_t activation_bytes;
    uint64_t kv_bytes;
    ...;
} kvdepot_fetch_plan;

typedef struct kvdepot_append_args {
    const void *id;
    size_t id_len;
    uint32_t layer_start;
    uint32_t num_layers;
    uint64_t token_start;
    uint64_t num_tokens;
    kvdepot_dtype dtype;
    const void *k;
    size_t k_bytes;
    const void *v;
    size_t v_bytes;
    const uint32_t *token_ids;
    size_t num_token_ids;
    kvdepot_engine_hashes engine_hashes;
    const kvdepot_create_args *create;
    int *created;
    ...;
} kvdepot_append_args;

typedef struct kvdepot_read_args {
    const void *id;
    size_t id_len;
    uint32_t layer_start;
    uint32_t num_layers;
    uint64_t token_start;
    uint64_t num_tokens;
    void *k;
    void *v;
    size_t capacity;
    ...;
} kvdepot_read_args;

typedef struct kvdepot_read_result {
    uint32_t layer_start;
    uint32_t num_layers;
    uint64_t token_start;
    uint64_t num_tokens;
    uint32_t num_kv_heads;
    uint32_t head_dim;
    kvdepot_dtype dtype;
    size_t kv_bytes;
    void *k;
    void *v;
    void *owned;
    ...;
} kvdepot_read_result;

typedef struct kvdepot_attend_query {
    const void *id;
    size_t id_len;
    const float *q;
    size_t q_len;
    uint64_t token_start;
    uint64_t num_tokens;
    ...;
} kvdepot_attend_query;

typedef struct kvdepot_attend_result {
    float *output;
    float *lse;
    size_t num_q_heads;
    size_t head_dim;
    uint64_t num_tokens;
    ...;
} kvdepot_attend_result;

typedef struct kvdepot_tier_stats {
    char name[];
    uint64_t limit_bytes;
    uint64_t bytes;
    uint64_t pages;
    uint64_t hits;
    uint64_t evictions;
    ...;
} kvdepot_tier_stats;

typedef struct kvdepot_stats {
    char durability[];
    kvdepot_tier_stats tiers[3];
    size_t num_tiers;
    uint64_t sequences;
    char backend[];
    char device[];
    uint64_t device_memory_bytes;
    int device_healthy;
    uint64_t mem_rss_bytes;
    uint64_t mem_appends_bytes;
    uint64_t mem_memtables_bytes;
    uint64_t mem_block_cache_bytes;
    ...;
} kvdepot_stats;

const char *kvdepot_status_name(int status);
const char *kvdepot_errmsg(const kvdepot_client *client);
void kvdepot_free(void *ptr);
size_t kvdepot_dtype_size(kvdepot_dtype dtype);
void kvdepot_options_init(kvdepot_options *opt);
int kvdepot_connect(const kvdepot_options *opt, kvdepot_client **out);
void kvdepot_close(kvdepot_client *client);
int kvdepot_health_check(kvdepot_client *client, const char *service, kvdepot_serving *out);
int kvdepot_model_put(kvdepot_client *client, const kvdepot_model *model, int replace,
                      kvdepot_model *out, int *created);
int kvdepot_model_get(kvdepot_client *client, const char *name, kvdepot_model *out);
int kvdepot_model_delete(kvdepot_client *client, const char *name, int force,
                         uint64_t *deleted_sequences);
void kvdepot_sequence_info_clear(kvdepot_sequence_info *info);
int kvdepot_sequence_create(kvdepot_client *client, const kvdepot_create_args *args,
                            kvdepot_sequence_info *out);
int kvdepot_sequence_stat(kvdepot_client *client, const void *id, size_t id_len,
                          kvdepot_sequence_info *out);
int kvdepot_sequence_list(kvdepot_client *client, const char *model,
                          kvdepot_sequence_info **out, size_t *count);
void kvdepot_sequence_list_free(kvdepot_sequence_info *list, size_t count);
int kvdepot_sequence_delete(kvdepot_client *client, const void *id, size_t id_len,
                            uint64_t *freed_pages);
int kvdepot_sequence_append(kvdepot_client *client, const kvdepot_append_args *args,
                            kvdepot_sequence_info *out);
int kvdepot_sequence_read(kvdepot_client *client, const kvdepot_read_args *args,
                          kvdepot_read_result *out);

typedef struct kvdepot_transfer kvdepot_transfer;
typedef void (*kvdepot_transfer_fn)(void *arg, kvdepot_transfer *t, int status);
int kvdepot_append_start(kvdepot_client *client, const kvdepot_append_args *args,
                         kvdepot_transfer_fn done, void *arg, kvdepot_transfer **out);
int kvdepot_read_start(kvdepot_client *client, const kvdepot_read_args *args,
                       kvdepot_read_result *result, kvdepot_transfer_fn done, void *arg,
                       kvdepot_transfer **out);
int kvdepot_transfer_poll(const kvdepot_transfer *t);
int kvdepot_transfer_wait(kvdepot_transfer *t, kvdepot_sequence_info *info);
int kvdepot_transfer_threads(unsigned n);

int kvdepot_model_list(kvdepot_client *client, kvdepot_model **out, size_t *count);

typedef struct kvdepot_page {
    void *data;
    size_t len;
} kvdepot_page;
typedef struct kvdepot_artifact {
    int kind;
    uint32_t layer;
    uint32_t kv_head;
    uint32_t ndim;
    uint32_t shape[2];
    float *data;
} kvdepot_artifact;
int kvdepot_encode_pages_with_artifacts(const kvdepot_model *model, const kvdepot_codecs *codecs,
                                        const kvdepot_artifact *artifacts, size_t n_artifacts,
                                        uint32_t page_tokens, uint32_t layer,
                                        uint64_t token_start, uint64_t num_tokens, const void *k,
                                        const void *v, kvdepot_page **pages, size_t *count);
void kvdepot_pages_free(kvdepot_page *pages, size_t count);
int kvdepot_sequence_read_pages(kvdepot_client *client, const kvdepot_read_args *args,
                                kvdepot_page **pages, size_t *count);
int kvdepot_append_pages(kvdepot_client *client, const void *id, size_t id_len,
                         const kvdepot_page *pages, size_t count, kvdepot_sequence_info *out);
typedef struct kvdepot_append_pages_args {
    const void *id;
    size_t id_len;
    const kvdepot_page *pages;
    size_t count;
    const kvdepot_create_args *create;
    int *created;
} kvdepot_append_pages_args;
int kvdepot_sequence_append_pages(kvdepot_client *client, const kvdepot_append_pages_args *args,
                                  kvdepot_sequence_info *out);
int kvdepot_artifacts_upload(kvdepot_client *client, const char *model,
                             const kvdepot_artifact *a, size_t count, uint32_t *stored);
int kvdepot_artifacts_get(kvdepot_client *client, const char *model, const int *kinds,
                          size_t nkinds, kvdepot_artifact **out, size_t *count);
void kvdepot_artifacts_free(kvdepot_artifact *a, size_t count);

typedef struct kvdepot_calibrate_args {
    const char *model;
    uint32_t vq_sub_dim;
    uint32_t vq_bits;
    int svd;
    uint32_t iterations;
    uint64_t seed;
    uint64_t max_samples;
    double error_budget;
    uint32_t eval_queries;
    int exhaustive;
    ...;
} kvdepot_calibrate_args;
typedef struct kvdepot_calibrate_sample {
    uint32_t layer;
    uint64_t num_tokens;
    const void *k, *v, *q;
    size_t kv_bytes;
    size_t q_bytes;
} kvdepot_calibrate_sample;
typedef struct kvdepot_calibration_error {
    uint32_t layer, kv_head;
    double vq_k, vq_v, svd_k, svd_v;
    uint32_t svd_width_k, svd_width_v;
} kvdepot_calibration_error;
typedef struct kvdepot_codec_eval {
    kvdepot_codec_spec codec;
    double bits_per_value;
    double attention_error;
} kvdepot_codec_eval;
typedef struct kvdepot_layer_advice {
    uint32_t layer;
    kvdepot_codec_eval *k, *v;
    size_t n_k, n_v;
    kvdepot_codec_spec k_recommended, v_recommended;
    double bits_per_value, attention_error;
    kvdepot_codec_spec k_best, v_best;
    double best_bits_per_value, best_attention_error;
} kvdepot_layer_advice;
typedef struct kvdepot_codec_advice {
    double error_budget;
    uint32_t eval_tokens, eval_queries;
    kvdepot_layer_advice *layers;
    size_t n_layers;
    kvdepot_codec_spec k, v;
    double bits_per_value, max_attention_error;
} kvdepot_codec_advice;
typedef struct kvdepot_calibrate_result {
    uint64_t samples;
    uint32_t artifacts;
    kvdepot_calibration_error *errors;
    size_t n_errors;
    kvdepot_codec_advice *advice;
} kvdepot_calibrate_result;
int kvdepot_calibrate(kvdepot_client *client, const kvdepot_calibrate_args *a,
                      const kvdepot_calibrate_sample *samples, size_t count,
                      kvdepot_calibrate_result *out);
void kvdepot_calibrate_result_clear(kvdepot_calibrate_result *r);

int kvdepot_attention_local(kvdepot_dtype dtype, uint32_t num_q_heads, uint32_t num_kv_heads,
                            uint32_t head_dim, float scale, const float *q, const void *k,
                            const void *v, uint64_t num_tokens, float *out, float *lse);
int kvdepot_attention_merge(uint32_t num_q_heads, uint32_t head_dim, float *out_a, float *lse_a,
                            const float *out_b, const float *lse_b);
int kvdepot_sequence_evict(kvdepot_client *client, const void *id, size_t id_len,
                           uint64_t *pages, uint64_t *bytes);
int kvdepot_attend(kvdepot_client *client, uint32_t layer, float scale,
                   const kvdepot_attend_query *queries, size_t n, kvdepot_attend_result *out);
int kvdepot_attend_dtype(kvdepot_client *client, uint32_t layer, float scale,
                         kvdepot_dtype q_dtype, const kvdepot_attend_query *queries, size_t n,
                         kvdepot_attend_result *out);
void kvdepot_attend_results_free(kvdepot_attend_result *results, size_t n);
int kvdepot_stats_get(kvdepot_client *client, kvdepot_stats *out);
typedef struct kvdepot_backup_info {
    uint64_t files, bytes, duration_ms;
} kvdepot_backup_info;
int kvdepot_backup(kvdepot_client *client, const char *dir, kvdepot_backup_info *out);
int kvdepot_search(kvdepot_client *client, const kvdepot_search_args *args,
                   kvdepot_search_result *out);
int kvdepot_sparse_attend(kvdepot_client *client, const kvdepot_search_args *args, float scale,
                          kvdepot_attend_result *out, kvdepot_search_result *tokens);
void kvdepot_search_result_free(kvdepot_search_result *r);
typedef struct kvdepot_pq_centroids {
    uint32_t layer, num_kv_heads, head_dim, m, bits;
    uint64_t centroids_id;
    float *data;
    size_t count;
} kvdepot_pq_centroids;
int kvdepot_pq_centroids_get(kvdepot_client *client, const void *id, size_t id_len,
                             uint32_t layer, kvdepot_pq_centroids *out);
void kvdepot_pq_centroids_free(kvdepot_pq_centroids *c);
int kvdepot_pq_rebuild(kvdepot_client *client, const void *id, size_t id_len,
                       uint32_t layer_start, uint32_t num_layers, uint32_t *layers_rebuilt,
                       uint64_t *tokens_indexed, kvdepot_sequence_info *info);
int kvdepot_plan_fetch(kvdepot_client *client, const void *id, size_t id_len,
                       double bandwidth_bytes_per_s, double compute_flops_per_s,
                       uint32_t layer_start, uint32_t num_layers, int assume_activations,
                       kvdepot_fetch_plan *out);
size_t kvdepot_prefix_hash_chain(const uint32_t *token_ids, size_t n, size_t page_tokens,
                                 uint64_t *out);
int kvdepot_engine_lookup(kvdepot_client *client, const char *model,
                          const kvdepot_engine_hashes *hashes, uint64_t *matched_blocks,
                          uint64_t *matched_tokens);
int kvdepot_prefix_lookup(kvdepot_client *client, const char *model, const uint64_t *hashes,
                          size_t n, uint64_t *matched_blocks, uint64_t *matched_tokens);
"""

HERE = os.path.dirname(os.path.abspath(__file__))
INCLUDE = os.environ.get("KVDEPOT_INCLUDE_DIR") or os.path.join(HERE, "..", "..", "include")
LIBDIR = os.environ.get("KVDEPOT_LIB_DIR")

ffi = FFI()
ffi.cdef(CDEF)
ffi.set_source(
    "kvdepot._native",
    '#include "kvdepot.h"',
    libraries=["kvdepot"],
    include_dirs=[INCLUDE],
    library_dirs=[LIBDIR] if LIBDIR else [],
    extra_link_args=["-Wl,-rpath," + LIBDIR] if LIBDIR else [],
)

if __name__ == "__main__":
    ffi.compile(verbose=True)
