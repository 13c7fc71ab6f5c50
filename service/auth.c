#include "auth.h"

#include <errno.h>
#include <fnmatch.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#include <yaml.h>

#include "config.h"

#define ANONYMOUS "anonymous"

static int fail(char *err, size_t errlen, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static int fail(char *err, size_t errlen, const char *fmt, ...)
{
    if (err && errlen) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, errlen, fmt, ap);
        va_end(ap);
    }
    return -1;
}

static void free_strv(char **v, size_t n)
{
    for (size_t i = 0; i < n; i++)
        free(v[i]);
    free(v);
}

static void auth_free(kvd_auth *a)
{
    for (size_t i = 0; i < a->n_tokens; i++) {
        /* Wipe secrets before the memory goes back to the allocator. */
        if (a->tokens[i].token) {
            volatile char *t = a->tokens[i].token;
            while (*t)
                *t++ = 0;
        }
        free(a->tokens[i].token);
        free_strv(a->tokens[i].namespaces, a->tokens[i].n_namespaces);
    }
    free(a->tokens);
    for (size_t i = 0; i < a->n_tenants; i++) {
        free(a->tenants[i].name);
        free_strv(a->tenants[i].namespaces, a->tenants[i].n_namespaces);
    }
    free(a->tenants);
    pthread_mutex_destroy(&a->mu);
    pthread_mutex_destroy(&a->commit_mu);
    free(a);
}

void kvd_auth_ref(kvd_auth *a)
{
    atomic_fetch_add(&a->refs, 1);
}

void kvd_auth_unref(kvd_auth *a)
{
    if (a && atomic_fetch_sub(&a->refs, 1) == 1)
        auth_free(a);
}

static int strv_add(char ***v, size_t *n, const char *s)
{
    for (size_t i = 0; i < *n; i++)
        if (strcmp((*v)[i], s) == 0)
            return 0;
    char **nv = realloc(*v, (*n + 1) * sizeof *nv);
    if (!nv)
        return -1;
    *v = nv;
    if (!(nv[*n] = strdup(s)))
        return -1;
    (*n)++;
    return 0;
}

static ssize_t tenant_find_or_add(kvd_auth *a, const char *name, uint64_t max_seq,
                                  uint64_t max_bytes)
{
    for (size_t i = 0; i < a->n_tenants; i++)
        if (strcmp(a->tenants[i].name, name) == 0)
            return (ssize_t)i;
    kvd_tenant *nt = realloc(a->tenants, (a->n_tenants + 1) * sizeof *nt);
    if (!nt)
        return -1;
    a->tenants = nt;
    kvd_tenant *t = &nt[a->n_tenants];
    memset(t, 0, sizeof *t);
    t->max_sequences = max_seq;
    t->max_bytes = max_bytes;
    if (!(t->name = strdup(name)))
        return -1;
    return (ssize_t)a->n_tenants++;
}

/* ---- the tokens file ------------------------------------------------------ */

typedef struct doc {
    yaml_document_t d;
    const char *path;
    char *err;
    size_t errlen;
} doc;

static int doc_fail(doc *D, yaml_node_t *n, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static int doc_fail(doc *D, yaml_node_t *n, const char *fmt, ...)
{
    char msg[384];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return fail(D->err, D->errlen, "tokens file %s:%lu: %s", D->path,
                n ? (unsigned long)n->start_mark.line + 1 : 0ul, msg);
}

static const char *scalar(yaml_node_t *n)
{
    return n && n->type == YAML_SCALAR_NODE ? (const char *)n->data.scalar.value : NULL;
}

/* "2027-01-01T00:00:00Z", "2027-01-01" (midnight UTC) or unix seconds. */
static int parse_time(const char *s, int64_t *out)
{
    struct tm tm;
    memset(&tm, 0, sizeof tm);
    int y, mo, d, h = 0, mi = 0, sec = 0;
    char z = 'Z';
    int n = 0;
    if (sscanf(s, "%4d-%2d-%2dT%2d:%2d:%2d%c%n", &y, &mo, &d, &h, &mi, &sec, &z, &n) == 7 &&
        (z == 'Z' || z == 'z') && s[n] == '\0') {
    } else if (sscanf(s, "%4d-%2d-%2d%n", &y, &mo, &d, &n) == 3 && s[n] == '\0') {
    } else {
        uint64_t v;
        if (kvd_config_parse_size(s, &v) != 0 || strpbrk(s, "KMGTkmgtBb"))
            return -1;
        *out = (int64_t)v;
        return 0;
    }
    if (mo < 1 || mo > 12 || d < 1 || d > 31 || h > 23 || mi > 59 || sec > 60)
        return -1;
    tm.tm_year = y - 1900;
    tm.tm_mon = mo - 1;
    tm.tm_mday = d;
    tm.tm_hour = h;
    tm.tm_min = mi;
    tm.tm_sec = sec;
    *out = (int64_t)timegm(&tm);
    return 0;
}

static int parse_token(doc *D, kvd_auth *a, yaml_node_t *n, uint64_t dseq, uint64_t dbytes)
{
    if (n->type != YAML_MAPPING_NODE)
        return doc_fail(D, n, "each entry of tokens must be a mapping");
    const char *token = NULL, *tenant = NULL, *access = "read-write", *expires = NULL;
    yaml_node_t *ns = NULL;
    for (yaml_node_pair_t *p = n->data.mapping.pairs.start; p < n->data.mapping.pairs.top; p++) {
        yaml_node_t *k = yaml_document_get_node(&D->d, p->key);
        yaml_node_t *v = yaml_document_get_node(&D->d, p->value);
        const char *key = scalar(k);
        if (!key)
            return doc_fail(D, k, "keys must be plain names");
        if (strcmp(key, "namespaces") == 0) {
            ns = v;
            continue;
        }
        const char *val = scalar(v);
        if (!val)
            return doc_fail(D, v, "%s: must be a single value", key);
        if (strcmp(key, "token") == 0)
            token = val;
        else if (strcmp(key, "tenant") == 0)
            tenant = val;
        else if (strcmp(key, "access") == 0)
            access = val;
        else if (strcmp(key, "expires") == 0)
            expires = val;
        else
            return doc_fail(D, k, "unknown key '%s' (token, tenant, namespaces, access, expires)",
                            key);
    }
    if (!token || strlen(token) < 16)
        return doc_fail(D, n, "token: missing or shorter than 16 characters");
    for (const char *c = token; *c; c++)
        if (*c <= ' ' || *c > '~')
            return doc_fail(D, n, "token: only printable ASCII without spaces");
    if (!tenant || !tenant[0])
        return doc_fail(D, n, "tenant: missing");
    /* The tenant names its namespace of sequence ids ("<tenant>/<id>"). */
    if (strlen(tenant) > 64 || strspn(tenant, "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
                                              "0123456789._-") != strlen(tenant))
        return doc_fail(D, n, "tenant: '%.80s' is not 1 to 64 of [A-Za-z0-9._-]", tenant);
    for (size_t i = 0; i < a->n_tokens; i++)
        if (strcmp(a->tokens[i].token, token) == 0)
            return doc_fail(D, n, "a token is listed twice (tenant %s)", tenant);
    int read_only, admin = 0;
    if (strcmp(access, "read-only") == 0 || strcmp(access, "ro") == 0)
        read_only = 1;
    else if (strcmp(access, "read-write") == 0 || strcmp(access, "rw") == 0)
        read_only = 0;
    else if (strcmp(access, "admin") == 0)
        read_only = 0, admin = 1;
    else
        return doc_fail(D, n, "access: '%s' is not read-only, read-write or admin", access);
    int64_t exp = 0;
    if (expires && parse_time(expires, &exp) != 0)
        return doc_fail(D, n, "expires: '%s' is not a UTC time like 2027-01-01T00:00:00Z", expires);
    ssize_t ti = tenant_find_or_add(a, tenant, dseq, dbytes);
    kvd_principal *nt = realloc(a->tokens, (a->n_tokens + 1) * sizeof *nt);
    if (ti < 0 || !nt)
        return doc_fail(D, n, "out of memory");
    a->tokens = nt;
    kvd_principal *p = &nt[a->n_tokens++];
    memset(p, 0, sizeof *p);
    p->tenant = (size_t)ti;
    p->read_only = read_only;
    p->admin = admin;
    p->expires = exp;
    if (!(p->token = strdup(token)))
        return doc_fail(D, n, "out of memory");
    if (!ns)
        return doc_fail(D, n, "namespaces: missing (use [\"*\"] for every model)");
    if (ns->type == YAML_SCALAR_NODE) {
        if (strv_add(&p->namespaces, &p->n_namespaces, scalar(ns)))
            return doc_fail(D, n, "out of memory");
    } else if (ns->type == YAML_SEQUENCE_NODE) {
        for (yaml_node_item_t *it = ns->data.sequence.items.start; it < ns->data.sequence.items.top;
             it++) {
            const char *g = scalar(yaml_document_get_node(&D->d, *it));
            if (!g || !g[0])
                return doc_fail(D, ns, "namespaces: entries must be non-empty globs");
            if (strv_add(&p->namespaces, &p->n_namespaces, g))
                return doc_fail(D, n, "out of memory");
        }
    } else {
        return doc_fail(D, ns, "namespaces: must be a list of globs");
    }
    if (p->n_namespaces == 0)
        return doc_fail(D, ns, "namespaces: empty (use [\"*\"] for every model)");
    kvd_tenant *t = &a->tenants[ti];
    for (size_t i = 0; i < p->n_namespaces; i++)
        if (strv_add(&t->namespaces, &t->n_namespaces, p->namespaces[i]))
            return doc_fail(D, n, "out of memory");
    return 0;
}

static int parse_tenants(doc *D, kvd_auth *a, yaml_node_t *n)
{
    if (n->type != YAML_MAPPING_NODE)
        return doc_fail(D, n, "tenants: must map tenant names to quotas");
    for (yaml_node_pair_t *p = n->data.mapping.pairs.start; p < n->data.mapping.pairs.top; p++) {
        yaml_node_t *k = yaml_document_get_node(&D->d, p->key);
        yaml_node_t *v = yaml_document_get_node(&D->d, p->value);
        const char *name = scalar(k);
        ssize_t ti = -1;
        for (size_t i = 0; name && i < a->n_tenants; i++)
            if (strcmp(a->tenants[i].name, name) == 0)
                ti = (ssize_t)i;
        if (ti < 0)
            return doc_fail(D, k, "tenants: '%s' has no token", name ? name : "?");
        if (v->type != YAML_MAPPING_NODE)
            return doc_fail(D, v, "tenants.%s: must be a mapping", name);
        for (yaml_node_pair_t *q = v->data.mapping.pairs.start; q < v->data.mapping.pairs.top;
             q++) {
            const char *key = scalar(yaml_document_get_node(&D->d, q->key));
            const char *val = scalar(yaml_document_get_node(&D->d, q->value));
            uint64_t x;
            if (!key || !val || kvd_config_parse_size(val, &x) != 0)
                return doc_fail(D, v, "tenants.%s: values must be numbers or sizes", name);
            if (strcmp(key, "max-sequences") == 0 || strcmp(key, "max_sequences") == 0)
                a->tenants[ti].max_sequences = x;
            else if (strcmp(key, "max-bytes") == 0 || strcmp(key, "max_bytes") == 0)
                a->tenants[ti].max_bytes = x;
            else
                return doc_fail(D, v, "tenants.%s: unknown key '%s' (max-sequences, max-bytes)",
                                name, key);
        }
    }
    return 0;
}

static int parse_file(const char *path, kvd_auth *a, uint64_t dseq, uint64_t dbytes, char *err,
                      size_t errlen)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return fail(err, errlen, "tokens file %s: %s", path, strerror(errno));
    yaml_parser_t p;
    doc D = {.path = path, .err = err, .errlen = errlen};
    if (!yaml_parser_initialize(&p)) {
        fclose(f);
        return fail(err, errlen, "tokens file %s: out of memory", path);
    }
    yaml_parser_set_input_file(&p, f);
    int rc;
    if (!yaml_parser_load(&p, &D.d)) {
        rc = fail(err, errlen, "tokens file %s:%lu: %s", path,
                  (unsigned long)p.problem_mark.line + 1, p.problem ? p.problem : "YAML error");
        yaml_parser_delete(&p);
        fclose(f);
        return rc;
    }
    yaml_parser_delete(&p);
    fclose(f);
    rc = 0;
    yaml_node_t *root = yaml_document_get_root_node(&D.d);
    yaml_node_t *tenants = NULL;
    if (!root || root->type != YAML_MAPPING_NODE) {
        rc = doc_fail(&D, root, "expected a mapping with a `tokens:` list");
        goto out;
    }
    yaml_node_t *tokens = NULL;
    for (yaml_node_pair_t *q = root->data.mapping.pairs.start; q < root->data.mapping.pairs.top;
         q++) {
        yaml_node_t *k = yaml_document_get_node(&D.d, q->key);
        const char *key = scalar(k);
        if (key && strcmp(key, "tokens") == 0)
            tokens = yaml_document_get_node(&D.d, q->value);
        else if (key && strcmp(key, "tenants") == 0)
            tenants = yaml_document_get_node(&D.d, q->value);
        else {
            rc = doc_fail(&D, k, "unknown key '%s' (tokens, tenants)", key ? key : "?");
            goto out;
        }
    }
    if (!tokens || tokens->type != YAML_SEQUENCE_NODE) {
        rc = doc_fail(&D, tokens ? tokens : root, "tokens: must be a list");
        goto out;
    }
    for (yaml_node_item_t *it = tokens->data.sequence.items.start;
         it < tokens->data.sequence.items.top && rc == 0; it++)
        rc = parse_token(&D, a, yaml_document_get_node(&D.d, *it), dseq, dbytes);
    if (rc == 0 && tenants)
        rc = parse_tenants(&D, a, tenants);
out:
    yaml_document_delete(&D.d);
    return rc;
}

int kvd_auth_load(const char *path, uint64_t max_sequences, uint64_t max_bytes, kvd_auth **out,
                  char *err, size_t errlen)
{
    *out = NULL;
    kvd_auth *a = calloc(1, sizeof *a);
    if (!a)
        return fail(err, errlen, "out of memory");
    atomic_init(&a->refs, 1);
    pthread_mutex_init(&a->mu, NULL);
    pthread_mutex_init(&a->commit_mu, NULL);
    int rc;
    if (path) {
        a->required = 1;
        rc = parse_file(path, a, max_sequences, max_bytes, err, errlen);
    } else {
        ssize_t ti = tenant_find_or_add(a, ANONYMOUS, max_sequences, max_bytes);
        rc = ti < 0 || strv_add(&a->tenants[0].namespaces, &a->tenants[0].n_namespaces, "*")
                 ? fail(err, errlen, "out of memory")
                 : 0;
    }
    if (rc) {
        auth_free(a);
        return -1;
    }
    *out = a;
    return 0;
}

/* ---- per-call checks ------------------------------------------------------ */

/* Compare without an early exit, so the time taken does not tell how much of
 * a guessed token was right. */
static int secret_equal(const char *a, size_t alen, const char *b)
{
    size_t blen = strlen(b);
    unsigned char diff = (unsigned char)(alen != blen);
    for (size_t i = 0; i < blen; i++)
        diff |= (unsigned char)(b[i] ^ (i < alen ? a[i] : 0));
    return diff == 0;
}

int kvd_auth_check(const kvd_auth *a, const grpc_metadata_array *md, int64_t now_unix,
                   const kvd_principal **out, kvd_error *err)
{
    *out = NULL;
    if (!a || !a->required)
        return 0;
    const char *val = NULL;
    size_t len = 0;
    for (size_t i = 0; i < md->count; i++) {
        const grpc_slice *k = &md->metadata[i].key;
        if (GRPC_SLICE_LENGTH(*k) == 13 &&
            strncasecmp((const char *)GRPC_SLICE_START_PTR(*k), "authorization", 13) == 0) {
            val = (const char *)GRPC_SLICE_START_PTR(md->metadata[i].value);
            len = GRPC_SLICE_LENGTH(md->metadata[i].value);
            break;
        }
    }
    if (!val)
        return kvd_error_set(err, KVD_EAUTH, "missing `authorization: Bearer <token>` metadata");
    if (len < 7 || strncasecmp(val, "Bearer ", 7) != 0)
        return kvd_error_set(err, KVD_EAUTH, "authorization: expected `Bearer <token>`");
    val += 7;
    len -= 7;
    const kvd_principal *found = NULL;
    for (size_t i = 0; i < a->n_tokens; i++)
        if (secret_equal(val, len, a->tokens[i].token) && !found)
            found = &a->tokens[i];
    if (!found)
        return kvd_error_set(err, KVD_EAUTH, "authorization: unknown token");
    if (found->expires && now_unix >= found->expires)
        return kvd_error_set(err, KVD_EAUTH, "authorization: token of tenant %s expired",
                             a->tenants[found->tenant].name);
    *out = found;
    return 0;
}

void kvd_auth_usage(kvd_auth *a, const kvd_principal *p, uint64_t *sequences, uint64_t *bytes)
{
    *sequences = *bytes = 0;
    if (!a || !p)
        return;
    pthread_mutex_lock(&a->mu);
    *sequences = a->tenants[p->tenant].sequences;
    *bytes = a->tenants[p->tenant].bytes;
    pthread_mutex_unlock(&a->mu);
}

size_t kvd_auth_tenant_usage(kvd_auth *a, kvd_tenant_usage **out)
{
    *out = NULL;
    if (!a)
        return 0;
    pthread_mutex_lock(&a->mu);
    kvd_tenant_usage *u = calloc(a->n_tenants ? a->n_tenants : 1, sizeof *u);
    size_t n = u ? a->n_tenants : 0;
    for (size_t i = 0; i < n; i++) {
        const kvd_tenant *t = &a->tenants[i];
        u[i] = (kvd_tenant_usage){t->name, t->sequences, t->bytes, t->max_sequences, t->max_bytes};
    }
    pthread_mutex_unlock(&a->mu);
    *out = u;
    return n;
}

const char *kvd_auth_tenant(const kvd_auth *a, const kvd_principal *p)
{
    return a && p ? a->tenants[p->tenant].name : ANONYMOUS;
}

static int match_any(char *const *globs, size_t n, const char *model)
{
    for (size_t i = 0; i < n; i++)
        if (fnmatch(globs[i], model, 0) == 0)
            return 1;
    return 0;
}

int kvd_auth_model_allowed(const kvd_principal *p, const char *model)
{
    return !p || match_any(p->namespaces, p->n_namespaces, model ? model : "");
}

/* ---- quotas ------------------------------------------------------------- */

int kvd_quota_reserve(kvd_auth *a, const char *model, uint64_t sequences, uint64_t bytes,
                      kvd_error *err)
{
    if (!a)
        return 0;
    int rc = 0;
    pthread_mutex_lock(&a->mu);
    for (size_t i = 0; i < a->n_tenants && !rc; i++) {
        kvd_tenant *t = &a->tenants[i];
        if (!match_any(t->namespaces, t->n_namespaces, model))
            continue;
        if (sequences && t->max_sequences && t->sequences + sequences > t->max_sequences)
            rc = kvd_error_set(err, KVD_ENOMEM,
                               "quota: tenant %s holds %llu of its %llu sequences "
                               "(tenant-max-sequences)",
                               t->name, (unsigned long long)t->sequences,
                               (unsigned long long)t->max_sequences);
        else if (bytes && t->max_bytes && t->bytes + bytes > t->max_bytes)
            rc = kvd_error_set(err, KVD_ENOMEM,
                               "quota: tenant %s holds %llu of its %llu bytes, %llu more do "
                               "not fit (tenant-max-bytes)",
                               t->name, (unsigned long long)t->bytes,
                               (unsigned long long)t->max_bytes, (unsigned long long)bytes);
    }
    if (!rc)
        for (size_t i = 0; i < a->n_tenants; i++) {
            kvd_tenant *t = &a->tenants[i];
            if (match_any(t->namespaces, t->n_namespaces, model)) {
                t->sequences += sequences;
                t->bytes += bytes;
                t->inflight_sequences += sequences;
                t->inflight_bytes += bytes;
            }
        }
    pthread_mutex_unlock(&a->mu);
    return rc;
}

static uint64_t sub_floor(uint64_t x, uint64_t y)
{
    return y < x ? x - y : 0;
}

/* Usage and/or in-flight amounts of model's tenants down by (seqs, bytes). */
static void quota_down(kvd_auth *a, const char *model, uint64_t sequences, uint64_t bytes,
                       int usage, int inflight)
{
    if (!a)
        return;
    pthread_mutex_lock(&a->mu);
    for (size_t i = 0; i < a->n_tenants; i++) {
        kvd_tenant *t = &a->tenants[i];
        if (!match_any(t->namespaces, t->n_namespaces, model))
            continue;
        if (usage) {
            t->sequences = sub_floor(t->sequences, sequences);
            t->bytes = sub_floor(t->bytes, bytes);
        }
        if (inflight) {
            t->inflight_sequences = sub_floor(t->inflight_sequences, sequences);
            t->inflight_bytes = sub_floor(t->inflight_bytes, bytes);
        }
    }
    pthread_mutex_unlock(&a->mu);
}

void kvd_quota_settle(kvd_auth *a, const char *model, uint64_t sequences, uint64_t bytes)
{
    quota_down(a, model, sequences, bytes, 0, 1);
}

void kvd_quota_forget(kvd_auth *a, const char *model, uint64_t sequences, uint64_t bytes)
{
    quota_down(a, model, sequences, bytes, 1, 0);
}

void kvd_quota_lock(kvd_auth *a)
{
    if (a)
        pthread_mutex_lock(&a->commit_mu);
}

void kvd_quota_unlock(kvd_auth *a)
{
    if (a)
        pthread_mutex_unlock(&a->commit_mu);
}

void kvd_quota_release(kvd_auth *a, const char *model, uint64_t sequences, uint64_t bytes)
{
    quota_down(a, model, sequences, bytes, 1, 1);
}

uint64_t kvd_seq_payload_bytes(const kvd_seq_info *s, const kvd_model_info *m)
{
    uint64_t per_token = 2ull * m->num_kv_heads * m->head_dim * kvd_dtype_size(m->dtype);
    uint64_t tokens = 0;
    for (uint32_t l = 0; l < s->num_layers && s->layer_tokens; l++)
        tokens += s->layer_tokens[l];
    /* Stored activations count like the K/V appended with them, and so do
     * the PQ index's centroids. */
    return tokens * per_token + s->activation_bytes + s->pq_bytes;
}

/* Counts go into local arrays and replace the tenants' usage in one step at
 * the end, so that calls reserving meanwhile never see a half-counted table;
 * a failed scan leaves the usage as it was. */
int kvd_auth_scan(kvd_auth *a, kvd_store *store, kvd_store_totals *tot, kvd_error *err)
{
    kvd_store_totals sum;
    memset(&sum, 0, sizeof sum);
    uint64_t *seqs_of = calloc(a->n_tenants + 1, sizeof *seqs_of);
    uint64_t *bytes_of = calloc(a->n_tenants + 1, sizeof *bytes_of);
    if (!seqs_of || !bytes_of) {
        free(seqs_of);
        free(bytes_of);
        return kvd_error_set(err, KVD_ENOMEM, "out of memory counting usage");
    }
    uint8_t after[KVD_SEQ_ID_MAX];
    size_t after_len = 0;
    int more = 1, rc = 0;
    kvd_model_info m;
    m.name[0] = '\0';
    /* No change that moves usage commits while the store is counted. */
    kvd_quota_lock(a);
    while (more && !rc) {
        kvd_seq_info *seqs = NULL;
        size_t n = 0;
        rc = kvd_store_seq_list(store, NULL, after_len ? after : NULL, after_len, 1024, &seqs, &n,
                                &more, err);
        for (size_t i = 0; i < n && !rc; i++) {
            if (strcmp(m.name, seqs[i].model) != 0 &&
                (rc = kvd_store_model_get(store, seqs[i].model, &m, err)))
                break;
            uint64_t b = kvd_seq_payload_bytes(&seqs[i], &m);
            sum.sequences++;
            sum.payload_bytes += b;
            sum.stored_bytes += seqs[i].stored_bytes;
            sum.sealed_pages += seqs[i].sealed_pages;
            /* Namespaces never change after load: no lock needed to match. */
            for (size_t t = 0; t < a->n_tenants; t++)
                if (match_any(a->tenants[t].namespaces, a->tenants[t].n_namespaces,
                              seqs[i].model)) {
                    seqs_of[t]++;
                    bytes_of[t] += b;
                }
        }
        if (n) {
            memcpy(after, seqs[n - 1].id, seqs[n - 1].id_len);
            after_len = seqs[n - 1].id_len;
        } else {
            more = 0;
        }
        for (size_t i = 0; i < n; i++)
            kvd_seq_info_clear(&seqs[i]);
        free(seqs);
    }
    if (!rc) {
        pthread_mutex_lock(&a->mu);
        for (size_t t = 0; t < a->n_tenants; t++) {
            a->tenants[t].sequences = seqs_of[t] + a->tenants[t].inflight_sequences;
            a->tenants[t].bytes = bytes_of[t] + a->tenants[t].inflight_bytes;
        }
        pthread_mutex_unlock(&a->mu);
        if (tot)
            *tot = sum;
    }
    kvd_quota_unlock(a);
    free(seqs_of);
    free(bytes_of);
    return rc;
}
