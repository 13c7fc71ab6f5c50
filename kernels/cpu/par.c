/*
 * One pool of compute threads for the whole process (cpu_internal.h,
 * kvd__par_for). Every request's op runs on its own thread (a server
 * worker) and lends the pool's idle threads the items it has not started;
 * the pool holds one thread fewer than the most threads a CPU backend was
 * created with (the CPUs the process may use, by default), and a helper
 * joins only while fewer threads compute, callers included, than that.
 *
 * Unlike an OpenMP team, an op never waits for a helper that has not
 * started: the caller takes every item nobody took, and waits only for the
 * items under way. On a busy machine a helper that is not scheduled costs
 * nothing (an OpenMP barrier waited for it a time slice, ~10 ms). Idle
 * helpers sleep on a condition variable; nothing spins.
 */
#include "common/cpu_internal.h"

#include <pthread.h>
#include <stdatomic.h>

typedef struct par_job {
    kvd__par_fn fn;
    void *arg;
    int n;
    int max_helpers;     /* threads - 1 */
    atomic_int next;     /* the next item to take */
    int helpers;         /* helpers inside (under mu) */
    struct par_job *nxt; /* in the list of jobs with items left (under mu) */
} par_job;

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t work = PTHREAD_COND_INITIALIZER; /* a job was added */
static pthread_cond_t left = PTHREAD_COND_INITIALIZER; /* a helper left a job */
static par_job *jobs;
static int idle;         /* helpers waiting for work */
static int pool_threads; /* helpers started */
static int cpus;         /* threads that may compute at once: the most a backend asked for */
static int computing;    /* callers inside kvd__par_for and helpers inside a job */

static void run_items(par_job *j)
{
    for (;;) {
        int i = atomic_fetch_add_explicit(&j->next, 1, memory_order_relaxed);
        if (i >= j->n)
            return;
        j->fn(j->arg, i);
    }
}

/* A job with items left and room for a helper, or NULL (under mu). A
 * helper joins only while fewer threads compute than there are CPUs: two
 * requests on two CPUs each run alone rather than share a helper that one
 * of them would wait for. */
static par_job *pick(void)
{
    if (computing >= cpus)
        return NULL;
    for (par_job *j = jobs; j; j = j->nxt)
        if (j->helpers < j->max_helpers &&
            atomic_load_explicit(&j->next, memory_order_relaxed) < j->n)
            return j;
    return NULL;
}

static void *helper_main(void *unused)
{
    (void)unused;
    pthread_mutex_lock(&mu);
    for (;;) {
        par_job *j = pick();
        if (!j) {
            idle++;
            pthread_cond_wait(&work, &mu);
            idle--;
            continue;
        }
        j->helpers++;
        computing++;
        pthread_mutex_unlock(&mu);
        run_items(j);
        pthread_mutex_lock(&mu);
        computing--;
        if (--j->helpers == 0)
            pthread_cond_broadcast(&left);
    }
    return NULL;
}

void kvd__par_size(int threads)
{
    pthread_mutex_lock(&mu);
    if (threads > cpus)
        cpus = threads > 256 ? 256 : threads;
    pthread_mutex_unlock(&mu);
}

/* Start helpers up to cpus - 1 (under mu); the number running. */
static int grow_pool(void)
{
    while (pool_threads < cpus - 1) {
        pthread_attr_t at;
        pthread_t t;
        pthread_attr_init(&at);
        pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
        const int rc = pthread_create(&t, &at, helper_main, NULL);
        pthread_attr_destroy(&at);
        if (rc != 0)
            break; /* the callers compute alone */
        pool_threads++;
    }
    return pool_threads;
}

int kvd__par_pool_threads(void)
{
    pthread_mutex_lock(&mu);
    int n = pool_threads;
    pthread_mutex_unlock(&mu);
    return n;
}

void kvd__par_for(int n, int threads, kvd__par_fn fn, void *arg)
{
    if (n <= 0)
        return;
    if (n == 1 || threads <= 1) {
        for (int i = 0; i < n; i++)
            fn(arg, i);
        return;
    }
    par_job j = {.fn = fn, .arg = arg, .n = n, .max_helpers = threads - 1};
    atomic_init(&j.next, 0);
    pthread_mutex_lock(&mu);
    if (grow_pool() == 0) { /* no helper could start */
        pthread_mutex_unlock(&mu);
        for (int i = 0; i < n; i++)
            fn(arg, i);
        return;
    }
    j.nxt = jobs;
    jobs = &j;
    computing++;
    int wake = j.max_helpers < n - 1 ? j.max_helpers : n - 1;
    if (wake > idle)
        wake = idle;
    if (wake > cpus - computing)
        wake = cpus - computing > 0 ? cpus - computing : 0;
    for (int w = 0; w < wake; w++)
        pthread_cond_signal(&work);
    pthread_mutex_unlock(&mu);

    run_items(&j);

    /* No helper joins once the job is off the list; wait for those in it
     * to finish the items they took. */
    pthread_mutex_lock(&mu);
    computing--;
    for (par_job **p = &jobs; *p; p = &(*p)->nxt)
        if (*p == &j) {
            *p = j.nxt;
            break;
        }
    while (j.helpers)
        pthread_cond_wait(&left, &mu);
    pthread_mutex_unlock(&mu);
}

typedef struct par_ranges {
    kvd__par_range_fn fn;
    void *arg;
    int64_t n, per;
} par_ranges;

static void range_item(void *arg, int i)
{
    const par_ranges *r = arg;
    const int64_t lo = (int64_t)i * r->per, hi = lo + r->per < r->n ? lo + r->per : r->n;
    if (lo < hi)
        r->fn(r->arg, lo, hi);
}

void kvd__par_ranges(int64_t n, int64_t grain, int threads, kvd__par_range_fn fn, void *arg)
{
    if (n <= 0)
        return;
    if (grain < 1)
        grain = 1;
    int64_t parts = threads > 1 ? 4 * (int64_t)threads : 1;
    if (parts > (n + grain - 1) / grain)
        parts = (n + grain - 1) / grain;
    if (parts <= 1) {
        fn(arg, 0, n);
        return;
    }
    par_ranges r = {fn, arg, n, (n + parts - 1) / parts};
    kvd__par_for((int)((n + r.per - 1) / r.per), threads, range_item, &r);
}
