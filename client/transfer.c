/*
 * Non-blocking appends and reads (kvdepot.h, "Non-blocking transfers").
 *
 * A transfer is a blocking kvdepot_sequence_append / kvdepot_sequence_read
 * run on a thread of a pool the library keeps for the process, so the
 * caller goes on (an engine computing layer l + 1 while layer l's cache
 * moves). Every call opens its own gRPC call, so transfers in flight share
 * the client's connection as HTTP/2 streams. The pool grows to its limit
 * as transfers wait and its idle threads sleep on a condition variable.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

enum { XFER_APPEND, XFER_READ };

struct kvdepot_transfer {
    int kind;
    kvdepot_client *client;
    kvdepot_append_args append;
    kvdepot_read_args read;
    kvdepot_read_result *read_out;
    kvdepot_sequence_info info; /* an append's answer */
    kvdepot_transfer_fn done_fn;
    void *done_arg;
    int rc;
    char msg[512];
    atomic_int done;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    struct kvdepot_transfer *next; /* queue */
};

static struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    kvdepot_transfer *head, *tail;
    unsigned threads, idle, max;
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, NULL, NULL, 0, 0, 8};

static void run(kvdepot_transfer *t)
{
    if (t->kind == XFER_APPEND)
        t->rc = kvdepot_sequence_append(t->client, &t->append, &t->info);
    else
        t->rc = kvdepot_sequence_read(t->client, &t->read, t->read_out);
    snprintf(t->msg, sizeof t->msg, "%s", t->rc ? kvdepot_errmsg(t->client) : "");
    if (t->done_fn)
        t->done_fn(t->done_arg, t, t->rc);
    pthread_mutex_lock(&t->mu);
    atomic_store(&t->done, 1);
    pthread_cond_broadcast(&t->cv);
    pthread_mutex_unlock(&t->mu);
}

static void *worker(void *arg)
{
    (void)arg;
    pthread_mutex_lock(&pool.mu);
    for (;;) {
        while (!pool.head) {
            pool.idle++;
            pthread_cond_wait(&pool.cv, &pool.mu);
            pool.idle--;
        }
        kvdepot_transfer *t = pool.head;
        pool.head = t->next;
        if (!pool.head)
            pool.tail = NULL;
        pthread_mutex_unlock(&pool.mu);
        run(t);
        pthread_mutex_lock(&pool.mu);
    }
    return NULL;
}

/* Queue t; a new thread when none is idle and the pool may grow. */
static int submit(kvdepot_client *c, kvdepot_transfer *t)
{
    pthread_mutex_lock(&pool.mu);
    t->next = NULL;
    if (pool.tail)
        pool.tail->next = t;
    else
        pool.head = t;
    pool.tail = t;
    int rc = 0;
    if (pool.idle == 0 && pool.threads < pool.max) {
        pthread_t th;
        pthread_attr_t at;
        pthread_attr_init(&at);
        pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
        if (pthread_create(&th, &at, worker, NULL) == 0)
            pool.threads++;
        else if (pool.threads == 0)
            rc = -1; /* nobody would ever run it */
        pthread_attr_destroy(&at);
    }
    if (rc) {
        pool.head = pool.tail = NULL;
    } else {
        pthread_cond_signal(&pool.cv);
    }
    pthread_mutex_unlock(&pool.mu);
    return rc ? kvdepot__fail(c, KVDEPOT_ENOMEM, "transfer: no thread to run it") : KVDEPOT_OK;
}

static kvdepot_transfer *transfer_new(kvdepot_client *c, int kind, kvdepot_transfer_fn fn,
                                      void *arg)
{
    kvdepot_transfer *t = calloc(1, sizeof *t);
    if (!t)
        return NULL;
    t->kind = kind;
    t->client = c;
    t->done_fn = fn;
    t->done_arg = arg;
    pthread_mutex_init(&t->mu, NULL);
    pthread_cond_init(&t->cv, NULL);
    return t;
}

static void transfer_free(kvdepot_transfer *t)
{
    pthread_mutex_destroy(&t->mu);
    pthread_cond_destroy(&t->cv);
    free(t);
}

int kvdepot_append_start(kvdepot_client *c, const kvdepot_append_args *a, kvdepot_transfer_fn done,
                         void *arg, kvdepot_transfer **out)
{
    kvdepot__clear_error();
    if (out)
        *out = NULL;
    if (!c || !a || !out)
        return kvdepot__fail(c, KVDEPOT_EINVAL, "append start: NULL argument");
    kvdepot_transfer *t = transfer_new(c, XFER_APPEND, done, arg);
    if (!t)
        return kvdepot__fail(c, KVDEPOT_ENOMEM, "append start: out of memory");
    t->append = *a;
    int rc = submit(c, t);
    if (rc) {
        transfer_free(t);
        return rc;
    }
    *out = t;
    return KVDEPOT_OK;
}

int kvdepot_read_start(kvdepot_client *c, const kvdepot_read_args *a, kvdepot_read_result *result,
                       kvdepot_transfer_fn done, void *arg, kvdepot_transfer **out)
{
    kvdepot__clear_error();
    if (out)
        *out = NULL;
    if (!c || !a || !result || !out)
        return kvdepot__fail(c, KVDEPOT_EINVAL, "read start: NULL argument");
    kvdepot_transfer *t = transfer_new(c, XFER_READ, done, arg);
    if (!t)
        return kvdepot__fail(c, KVDEPOT_ENOMEM, "read start: out of memory");
    t->read = *a;
    t->read_out = result;
    int rc = submit(c, t);
    if (rc) {
        transfer_free(t);
        return rc;
    }
    *out = t;
    return KVDEPOT_OK;
}

int kvdepot_transfer_poll(const kvdepot_transfer *t)
{
    return t ? atomic_load(&((kvdepot_transfer *)t)->done) : 1;
}

int kvdepot_transfer_wait(kvdepot_transfer *t, kvdepot_sequence_info *info)
{
    kvdepot__clear_error();
    if (info)
        memset(info, 0, sizeof *info);
    if (!t)
        return kvdepot__fail(NULL, KVDEPOT_EINVAL, "transfer wait: NULL transfer");
    pthread_mutex_lock(&t->mu);
    while (!atomic_load(&t->done))
        pthread_cond_wait(&t->cv, &t->mu);
    pthread_mutex_unlock(&t->mu);
    const int rc = t->rc;
    kvdepot_client *c = t->client;
    if (info)
        *info = t->info; /* moved: the caller clears it */
    else
        kvdepot_sequence_info_clear(&t->info);
    if (rc)
        kvdepot__fail(c, rc, "%s", t->msg);
    transfer_free(t);
    return rc;
}

int kvdepot_transfer_threads(unsigned n)
{
    kvdepot__clear_error();
    if (n < 1 || n > 256)
        return kvdepot__fail(NULL, KVDEPOT_EINVAL, "transfer threads: %u, want 1..256", n);
    pthread_mutex_lock(&pool.mu);
    pool.max = n; /* threads beyond it stay, idle, until the process ends */
    pthread_mutex_unlock(&pool.mu);
    return KVDEPOT_OK;
}
