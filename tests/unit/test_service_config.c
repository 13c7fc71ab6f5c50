/*
 * Unit tests of kvdepotd's settings table and flag parser, request field
 * checks, log quoting and method table.
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "config.h"
#include "convert.h"
#include "log.h"
#include "rpc.h"
#include "validate.h"

static int failures;

#define CHECK(cond)                                                         \
    do {                                                                    \
        if (!(cond)) {                                                      \
            fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
            failures++;                                                     \
        }                                                                   \
    } while (0)

#define MiB (1024ull * 1024)

/* Parse a NULL-terminated list of arguments into c (on top of defaults). */
static int parse(kvd_config *c, int *action, char *err, size_t errlen, ...)
{
    char *argv[32];
    int argc = 0;
    argv[argc++] = "kvdepotd";
    va_list ap;
    va_start(ap, errlen);
    char *a;
    while ((a = va_arg(ap, char *)) != NULL && argc < 31)
        argv[argc++] = a;
    va_end(ap);
    argv[argc] = NULL;
    kvd_config_free(c);
    if (kvd_config_defaults(c) != 0)
        return -2;
    err[0] = '\0';
    return kvd_config_parse_args(c, argc, argv, action, err, errlen);
}

static void test_defaults(void)
{
    kvd_config c;
    CHECK(kvd_config_defaults(&c) == 0);
    CHECK(strcmp(c.listen, "127.0.0.1:50051") == 0);
    CHECK(strcmp(c.data_dir, "./kvdepot-data") == 0);
    CHECK(c.threads == 0);
    CHECK(c.page_tokens == 0); /* 0: the data directory decides */
    CHECK(c.sync == 0);
    CHECK(c.max_message_bytes == 8 * MiB);
    CHECK(c.max_append_bytes == 2048 * MiB);
    CHECK(c.log_level == KVD_LOG_INFO);
    CHECK(c.port_file == NULL);
    CHECK(c.shutdown_grace_ms > 0);
    kvd_config_free(&c);
    kvd_config_free(&c); /* idempotent */
}

static void test_flags(void)
{
    kvd_config c;
    memset(&c, 0, sizeof c);
    char err[256];
    int action = -1;

    CHECK(parse(&c, &action, err, sizeof err, "--listen", "0.0.0.0:7000", "--data-dir=/tmp/x",
                "--threads", "3", "--page-tokens=64", "--sync", "--max-message-bytes", "16MiB",
                "--max-append-bytes=1G", "--log-level", "debug", "--port-file", "/tmp/p",
                NULL) == 0);
    CHECK(action == KVD_CONFIG_RUN);
    CHECK(strcmp(c.listen, "0.0.0.0:7000") == 0);
    CHECK(strcmp(c.data_dir, "/tmp/x") == 0);
    CHECK(c.threads == 3);
    CHECK(c.page_tokens == 64);
    CHECK(c.sync == 1);
    CHECK(c.max_message_bytes == 16 * MiB);
    CHECK(c.max_append_bytes == 1024 * MiB);
    CHECK(c.log_level == KVD_LOG_DEBUG);
    CHECK(c.port_file && strcmp(c.port_file, "/tmp/p") == 0);

    /* Size spellings. */
    CHECK(parse(&c, &action, err, sizeof err, "--max-message-bytes=65536B", NULL) == 0 &&
          c.max_message_bytes == 65536);
    CHECK(parse(&c, &action, err, sizeof err, "--max-message-bytes=65536", NULL) == 0 &&
          c.max_message_bytes == 65536);
    CHECK(parse(&c, &action, err, sizeof err, "--max-message-bytes=64k", NULL) == 0 &&
          c.max_message_bytes == 65536);
    CHECK(parse(&c, &action, err, sizeof err, "--max-message-bytes=2M", NULL) == 0 &&
          c.max_message_bytes == 2 * MiB);
    CHECK(parse(&c, &action, err, sizeof err, "--max-message-bytes=3MB", NULL) == 0 &&
          c.max_message_bytes == 3 * MiB);

    /* Booleans. */
    CHECK(parse(&c, &action, err, sizeof err, "--sync=false", NULL) == 0 && c.sync == 0);
    CHECK(parse(&c, &action, err, sizeof err, "--sync=yes", NULL) == 0 && c.sync == 1);
    CHECK(parse(&c, &action, err, sizeof err, "--sync", "--no-sync", NULL) == 0 && c.sync == 0);

    /* Later flags win. */
    CHECK(parse(&c, &action, err, sizeof err, "--threads=2", "--threads=5", NULL) == 0 &&
          c.threads == 5);

    /* Actions. */
    CHECK(parse(&c, &action, err, sizeof err, "--help", NULL) == 0 && action == KVD_CONFIG_HELP);
    CHECK(parse(&c, &action, err, sizeof err, "--version", NULL) == 0 &&
          action == KVD_CONFIG_VERSION);
    kvd_config_free(&c);
}

static void test_bad_values(void)
{
    kvd_config c;
    memset(&c, 0, sizeof c);
    char err[256];
    int action;
    struct {
        const char *a, *b;
        const char *mention; /* the message must name the option */
    } bad[] = {
        {"--threads", "257", "threads"},
        {"--threads", "-1", "threads"},
        {"--threads", "two", "threads"},
        {"--threads", "", "threads"},
        {"--threads", "3x", "threads"},
        {"--page-tokens", "65537", "page-tokens"},
        {"--page-tokens", "99999999999999999999999", "page-tokens"},
        {"--max-message-bytes", "1K", "max-message-bytes"},
        {"--max-message-bytes", "4G", "max-message-bytes"},
        {"--max-message-bytes", "17179869184T", "max-message-bytes"},
        {"--max-message-bytes", "8Q", "max-message-bytes"},
        {"--max-append-bytes", "0", "max-append-bytes"},
        {"--log-level", "loud", "log-level"},
        {"--listen", "", "listen"},
        {"--data-dir", "", "data-dir"},
        {"--sync=maybe", NULL, "sync"},
        {"--shutdown-grace-ms", "9999999", "shutdown-grace-ms"},
        {"--bogus", NULL, "bogus"},
        {"--no-listen", NULL, "no-listen"},
        {"stray", NULL, "stray"},
        {"--listen", NULL, "listen"}, /* missing value */
        {"--durability", "fast", "durability"},
        {"--wal-recovery", "lenient", "wal-recovery"},
        {"--log-format", "xml", "log-format"},
        {"--device", "gpu", "device"},
        {"--device", "cuda:", "device"},
        {"--device", "cuda:x", "device"},
        {"--device", "cuda:12345", "device"},
        {"--background-priority", "0", "background-priority"},
        {"--background-priority", "20", "background-priority"},
        {"--background-priority", "-1", "background-priority"},
        {"--background-priority", "5x", "background-priority"},
        {"--background-priority", "IDLE", "background-priority"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        int rc = bad[i].b ? parse(&c, &action, err, sizeof err, bad[i].a, bad[i].b, NULL)
                          : parse(&c, &action, err, sizeof err, bad[i].a, NULL);
        if (rc != -1 || !strstr(err, bad[i].mention)) {
            fprintf(stderr, "bad value accepted or message unclear: %s %s -> rc %d '%s'\n",
                    bad[i].a, bad[i].b ? bad[i].b : "", rc, err);
            failures++;
        }
    }
    /* A failed set leaves the old value. */
    CHECK(kvd_config_set(&c, "threads", "7", err, sizeof err) == 0 && c.threads == 7);
    CHECK(kvd_config_set(&c, "threads", "700", err, sizeof err) == -1 && c.threads == 7);
    CHECK(kvd_config_set(&c, "nonsense", "1", err, sizeof err) == -1);
    /* the string settings of a few forms take each of them, and keep the
     * old value when refused */
    const char *good[][2] = {
        {"durability", "none"},
        {"durability", "spill"},
        {"durability", "sync"},
        {"wal-recovery", "strict"},
        {"wal-recovery", "point-in-time"},
        {"log-format", "json"},
        {"log-format", "logfmt"},
        {"device", "auto"},
        {"device", "cpu"},
        {"device", "cuda"},
        {"device", "cuda:0"},
        {"device", "cuda:15"},
        {"background-priority", "idle"},
        {"background-priority", "off"},
        {"background-priority", "1"},
        {"background-priority", "19"},
    };
    for (size_t i = 0; i < sizeof good / sizeof good[0]; i++)
        if (kvd_config_set(&c, good[i][0], good[i][1], err, sizeof err) != 0) {
            fprintf(stderr, "refused: --%s %s: %s\n", good[i][0], good[i][1], err);
            failures++;
        }
    CHECK(kvd_config_set(&c, "durability", "fast", err, sizeof err) == -1 &&
          strcmp(c.durability, "sync") == 0);
    int v = 0, cuda = 0, index = 0;
    CHECK(kvd_config_parse_background("idle", &v) == 0 && v == 20);
    CHECK(kvd_config_parse_background("off", &v) == 0 && v == -1);
    CHECK(kvd_config_parse_background("7", &v) == 0 && v == 7);
    CHECK(kvd_config_parse_durability("none", &v) == 0 && v == 0);
    CHECK(kvd_config_parse_durability("sync", &v) == 0 && v == 2);
    CHECK(kvd_config_parse_device("cpu", &cuda, &index) == 0 && cuda == -1 && index == -1);
    CHECK(kvd_config_parse_device("auto", &cuda, &index) == 0 && cuda == 0 && index == -1);
    CHECK(kvd_config_parse_device("cuda:3", &cuda, &index) == 0 && cuda == 1 && index == 3);
    kvd_config_free(&c);
}

static char *fake_env(const char *name)
{
    if (strcmp(name, "KVDEPOT_DATA_DIR") == 0)
        return "/env/dir";
    if (strcmp(name, "KVDEPOT_MAX_MESSAGE_BYTES") == 0)
        return "1M";
    if (strcmp(name, "KVDEPOT_THREADS") == 0)
        return "4";
    return NULL;
}

static char *bad_env(const char *name)
{
    return strcmp(name, "KVDEPOT_PAGE_TOKENS") == 0 ? "lots" : NULL;
}

static void test_env(void)
{
    kvd_config c;
    char err[256];
    CHECK(kvd_config_defaults(&c) == 0);
    CHECK(kvd_config_apply_env(&c, fake_env, err, sizeof err) == 0);
    CHECK(strcmp(c.data_dir, "/env/dir") == 0);
    CHECK(c.max_message_bytes == MiB);
    CHECK(c.threads == 4);
    char *argv[] = {"kvdepotd", "--threads", "2", NULL};
    int action;
    CHECK(kvd_config_parse_args(&c, 3, argv, &action, err, sizeof err) == 0);
    CHECK(c.threads == 2); /* flags win over the environment */
    CHECK(kvd_config_apply_env(&c, bad_env, err, sizeof err) == -1);
    CHECK(strstr(err, "KVDEPOT_PAGE_TOKENS") != NULL);
    kvd_config_free(&c);
}

static void test_help_lists_everything(void)
{
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    CHECK(f != NULL);
    if (!f)
        return;
    kvd_config_usage(f, "kvdepotd");
    fclose(f);
    CHECK(kvd_config_count() >= 10);
    for (size_t i = 0; i < kvd_config_count(); i++) {
        char flag[96];
        snprintf(flag, sizeof flag, "--%s ", kvd_config_name(i));
        if (!strstr(text, flag)) {
            fprintf(stderr, "--help does not list %s\n", flag);
            failures++;
        }
    }
    const char *required[] = {"--listen", "--data-dir", "--threads", "--page-tokens", "--sync",
                              "--max-message-bytes", "--max-append-bytes", "--log-level",
                              "--port-file", "--help", "--version"};
    for (size_t i = 0; i < sizeof required / sizeof required[0]; i++)
        if (!strstr(text, required[i])) {
            fprintf(stderr, "--help does not mention %s\n", required[i]);
            failures++;
        }
    free(text);
}

static void test_validate(void)
{
    kvd_error e;
    uint8_t id[300] = {0};
    CHECK(kvd_check_seq_id(id, 1, "sequence_id", &e) == 0);
    CHECK(kvd_check_seq_id(id, 256, "sequence_id", &e) == 0);
    CHECK(kvd_check_seq_id(id, 0, "sequence_id", &e) == KVD_EINVAL &&
          strstr(e.msg, "sequence_id"));
    CHECK(kvd_check_seq_id(id, 257, "header.sequence_id", &e) == KVD_EINVAL &&
          strstr(e.msg, "header.sequence_id"));
    CHECK(kvd_check_model_name("llama-3.1_8B", "model", &e) == 0);
    CHECK(kvd_check_model_name("", "model", &e) == KVD_EINVAL);
    CHECK(kvd_check_model_name("a/b", "model", &e) == KVD_EINVAL && strstr(e.msg, "model"));
    CHECK(kvd_check_model_name(".", "model", &e) == KVD_EINVAL);
    CHECK(kvd_check_model_name("..", "model", &e) == KVD_EINVAL);
    CHECK(kvd_check_model_name("...", "model", &e) == 0);
    char longname[200];
    memset(longname, 'a', sizeof longname - 1);
    longname[sizeof longname - 1] = '\0';
    CHECK(kvd_check_model_name(longname, "name", &e) == KVD_EINVAL);
    CHECK(kvd_check_dtype(1, "dtype", &e) == 0 && kvd_check_dtype(3, "dtype", &e) == 0);
    CHECK(kvd_check_dtype(0, "dtype", &e) == KVD_EINVAL);
    CHECK(kvd_check_dtype(4, "dtype", &e) == KVD_EINVAL);
    CHECK(kvd_check_dtype(-1, "dtype", &e) == KVD_EINVAL);
    CHECK(kvd_check_range(UINT64_MAX - 5, 5, 64, "a", "b", &e) == 0);
    CHECK(kvd_check_range(UINT64_MAX - 5, 6, 64, "a", "b", &e) == KVD_EINVAL &&
          strstr(e.msg, "a + b"));
    CHECK(kvd_check_range(UINT32_MAX, 0, 32, "l", "n", &e) == 0);
    CHECK(kvd_check_range(UINT32_MAX, 1, 32, "l", "n", &e) == KVD_EINVAL);
}

static void test_log_quote(void)
{
    char buf[64];
    kvd_log_quote(buf, sizeof buf, "plain", 5);
    CHECK(strcmp(buf, "plain") == 0);
    kvd_log_quote(buf, sizeof buf, "two words", 9);
    CHECK(strcmp(buf, "\"two words\"") == 0);
    kvd_log_quote(buf, sizeof buf, "a\"b\nc\x01", 6);
    CHECK(strcmp(buf, "\"a\\\"b\\nc\\x01\"") == 0);
    kvd_log_quote(buf, sizeof buf, "", 0);
    CHECK(strcmp(buf, "\"\"") == 0);
    char small[4];
    kvd_log_quote(small, sizeof small, "abcdef", 6);
    CHECK(strlen(small) == 3);
    CHECK(kvd_log_level_parse("warn") == KVD_LOG_WARN && kvd_log_level_parse("x") == -1);
}

static void test_method_table(void)
{
    CHECK(kvd_methods_count >= 13);
    for (size_t i = 0; i < kvd_methods_count; i++) {
        const kvd_method *m = &kvd_methods[i];
        CHECK(m->path[0] == '/');
        CHECK(kvd_method_find(m->path, strlen(m->path)) == m);
        if (m->kind == KVD_RPC_UNARY)
            CHECK(m->unary && m->request);
        else if (m->kind == KVD_RPC_SERVER_STREAM)
            CHECK(m->stream && m->stream->start && m->stream->next && m->request);
        else
            CHECK(m->stream && m->stream->recv && m->stream->finish);
    }
    const char *p = "/kvdepot.v1.KVDepot/Append";
    const kvd_method *m = kvd_method_find(p, strlen(p));
    CHECK(m && m->kind == KVD_RPC_CLIENT_STREAM);
    p = "/kvdepot.v1.KVDepot/Read";
    m = kvd_method_find(p, strlen(p));
    CHECK(m && m->kind == KVD_RPC_SERVER_STREAM);
    p = "/grpc.health.v1.Health/Check";
    CHECK(kvd_method_find(p, strlen(p)) != NULL);
    p = "/kvdepot.v1.KVDepot/Appendx";
    CHECK(kvd_method_find(p, strlen(p)) == NULL);
    CHECK(kvd_method_find(p, 0) == NULL);
}

/* A received message of raw bytes through kvd_bb_unpack: 0, or the code
 * with *msg the reason. */
static int unpack_raw(const ProtobufCMessageDescriptor *d, const void *bytes, size_t n,
                      kvd_error *why)
{
    grpc_slice s = grpc_slice_from_copied_buffer(bytes, n);
    grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(&s, 1);
    grpc_slice_unref(s);
    kvd_error_clear(why);
    ProtobufCMessage *m = kvd_bb_unpack(d, bb, why);
    grpc_byte_buffer_destroy(bb);
    if (m)
        protobuf_c_message_free_unpacked(m, NULL);
    return m ? 0 : why->code ? why->code : -1;
}

/* String fields are checked on the wire, with their length: protobuf-c
 * would hand "a\0b" over as "a". */
static void test_wire_strings(void)
{
    kvd_error e;
    const ProtobufCMessageDescriptor *get = &kvdepot__v1__get_model_request__descriptor;
    const ProtobufCMessageDescriptor *put = &kvdepot__v1__put_model_request__descriptor;
    /* GetModelRequest.name = field 1 */
    CHECK(unpack_raw(get, "\x0a\x03" "abc", 5, &e) == 0);
    CHECK(unpack_raw(get, "\x0a\x03" "a\0b", 5, &e) == KVD_EINVAL &&
          strstr(e.msg, "name: NUL byte at offset 1"));
    CHECK(unpack_raw(get, "\x0a\x04\xf0\x9f\x98\x80", 6, &e) == 0); /* U+1F600 */
    CHECK(unpack_raw(get, "\x0a\x02\xc3\xa9", 4, &e) == 0);            /* U+00E9 */
    const char *bad[] = {"\xff", "\xc0\x80" /* overlong NUL */, "\xed\xa0\x80" /* surrogate */,
                         "\xf4\x90\x80\x80" /* past U+10FFFF */, "\xe2\x82" /* cut short */,
                         "\x80"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        uint8_t msg[16] = {0x0a, (uint8_t)strlen(bad[i])};
        memcpy(msg + 2, bad[i], strlen(bad[i]));
        CHECK(unpack_raw(get, msg, 2 + strlen(bad[i]), &e) == KVD_EINVAL &&
              strstr(e.msg, "name: not UTF-8"));
    }
    /* PutModelRequest.model (1) { name (1) = "a\0b", revision (2) = "r" } */
    const uint8_t nested[] = {0x0a, 0x08, 0x0a, 0x03, 'a', 0, 'b', 0x12, 0x01, 'r'};
    CHECK(unpack_raw(put, nested, sizeof nested, &e) == KVD_EINVAL &&
          strstr(e.msg, "model.name: NUL byte"));
    const uint8_t nested_rev[] = {0x0a, 0x08, 0x0a, 0x01, 'a', 0x12, 0x03, 'r', 0xfe, 'r'};
    CHECK(unpack_raw(put, nested_rev, sizeof nested_rev, &e) == KVD_EINVAL &&
          strstr(e.msg, "model.revision: not UTF-8"));
    /* bytes fields may hold anything: StatSequenceRequest.sequence_id */
    CHECK(unpack_raw(&kvdepot__v1__stat_sequence_request__descriptor, "\x0a\x02\x00\xff", 4,
                     &e) == 0);
    /* a message that does not parse says nothing more */
    CHECK(unpack_raw(get, "\x0a\x7f", 2, &e) == -1);
}

/* Write text to dir/name (dir/memory made first). */
static void put_file(const char *dir, const char *name, const char *text)
{
    char path[512];
    snprintf(path, sizeof path, "%s/memory", dir);
    mkdir(path, 0700);
    snprintf(path, sizeof path, "%s/cpu", dir);
    mkdir(path, 0700);
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "w");
    CHECK(f != NULL);
    if (f) {
        fputs(text, f);
        fclose(f);
    }
}

/* The memory tiers' "auto" sizes: the default, printed as auto, sized from
 * the machine's memory on the CPU and from the GPU's free memory with one;
 * a size given is kept; the memory kvdepotd may use is the cgroup's limit
 * when lower than the machine's. */
static void test_tier_sizes(void)
{
    kvd_config c;
    memset(&c, 0, sizeof c);
    char err[256];
    int action;
    const unsigned long long GiB = 1024 * MiB;
    CHECK(parse(&c, &action, err, sizeof err, (char *)NULL) == 0);
    CHECK(c.device_tier_bytes == KVD_CONFIG_AUTO && c.host_tier_bytes == KVD_CONFIG_AUTO);
    uint64_t dev = 0, host = 0;
    kvd_config_tiers(&c, 24 * GiB + 12345, 0, &dev, &host); /* CPU */
    CHECK(dev == 3 * GiB && host == 3 * GiB);
    kvd_config_tiers(&c, 1024 * GiB, 80 * GiB, &dev, &host); /* GPU: keep 1/8 of 80 */
    CHECK(dev == 70 * GiB && host == 64 * GiB);
    kvd_config_tiers(&c, 16 * GiB, 4 * GiB + 3, &dev, &host); /* GPU: keep 1 GiB */
    CHECK(dev == 3 * GiB && host == 4 * GiB);
    kvd_config_tiers(&c, 16 * GiB, 512 * MiB, &dev, &host); /* too little to keep a tier */
    CHECK(dev == 0);
    CHECK(parse(&c, &action, err, sizeof err, "--device-tier-bytes", "64MiB", "--host-tier-bytes",
                "0", (char *)NULL) == 0);
    kvd_config_tiers(&c, 24 * GiB, 80 * GiB, &dev, &host);
    CHECK(dev == 64 * MiB && host == 0);
    CHECK(kvd_config_append_memory(&c, 24 * GiB + 12345) == 3 * GiB); /* still auto */
    CHECK(parse(&c, &action, err, sizeof err, "--append-memory-bytes", "0", (char *)NULL) == 0);
    CHECK(kvd_config_append_memory(&c, 24 * GiB) == 0); /* unlimited */
    CHECK(parse(&c, &action, err, sizeof err, "--host-tier-bytes", "autox", (char *)NULL) != 0);
    CHECK(strstr(err, "host-tier-bytes") && strstr(err, "or auto"));
    CHECK(parse(&c, &action, err, sizeof err, "--max-append-bytes", "auto", (char *)NULL) != 0);
    /* printed as auto, and read back from it */
    CHECK(parse(&c, &action, err, sizeof err, "--device-tier-bytes", "auto", (char *)NULL) == 0);
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    kvd_config_print(f, &c);
    fclose(f);
    CHECK(strstr(text, "\ndevice-tier-bytes: auto") && strstr(text, "\nhost-tier-bytes: auto"));
    free(text);
    kvd_config_free(&c);

    /* The cgroup's limit, when lower. */
    char root[] = "/tmp/kvd-cgroup-XXXXXX";
    CHECK(mkdtemp(root) != NULL);
    const uint64_t phys = kvd_machine_memory(root); /* no limit files */
    CHECK(phys > 64 * MiB);
    put_file(root, "memory.max", "max\n");
    CHECK(kvd_machine_memory(root) == phys);
    put_file(root, "memory.max", "1073741824\n");
    CHECK(kvd_machine_memory(root) == GiB);
    put_file(root, "memory.max", "max\n");
    put_file(root, "memory/memory.limit_in_bytes", "9223372036854771712\n"); /* v1: none */
    CHECK(kvd_machine_memory(root) == phys);
    put_file(root, "memory/memory.limit_in_bytes", "536870912\n");
    CHECK(kvd_machine_memory(root) == 512 * MiB);

    /* CPUs: the affinity's, or the cgroup's quota rounded up when lower */
    const unsigned cpus = kvd_machine_cpus(root); /* no quota files */
    CHECK(cpus >= 1);
    put_file(root, "cpu/cpu.cfs_quota_us", "-1\n"); /* v1: none */
    put_file(root, "cpu/cpu.cfs_period_us", "100000\n");
    CHECK(kvd_machine_cpus(root) == cpus);
    put_file(root, "cpu/cpu.cfs_quota_us", "50000\n");
    CHECK(kvd_machine_cpus(root) == 1);
    put_file(root, "cpu.max", "max 100000\n"); /* v2 first: none */
    CHECK(kvd_machine_cpus(root) == cpus);
    put_file(root, "cpu.max", "150000 100000\n");
    CHECK(kvd_machine_cpus(root) == (cpus < 2 ? cpus : 2));
    put_file(root, "cpu.max", "100000000 100000\n"); /* more than the machine */
    CHECK(kvd_machine_cpus(root) == cpus);
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", root);
    CHECK(system(cmd) == 0);
}

int main(void)
{
    test_wire_strings();
    test_tier_sizes();
    test_defaults();
    test_flags();
    test_bad_values();
    test_env();
    test_help_lists_everything();
    test_validate();
    test_log_quote();
    test_method_table();
    if (failures) {
        fprintf(stderr, "%d check(s) failed\n", failures);
        return 1;
    }
    printf("service config tests passed\n");
    return 0;
}
