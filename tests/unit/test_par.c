/*
 * The process's compute pool (kernels/cpu/par.c, kvd__par_for):
 *
 *  - every item runs exactly once, with several callers at the same time;
 *  - a caller alone gets help: its items run on more than one thread;
 *  - a caller never waits for a helper that is busy elsewhere: with every
 *    helper held inside another job, a job still finishes, on its caller
 *    alone (an OpenMP team would wait for its threads at the barrier; here
 *    that would hang, and the alarm fails the test).
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/cpu_internal.h"

static int failures;
#define CHECK(cond)                                                                                \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond);               \
            failures++;                                                                            \
        }                                                                                          \
    } while (0)

#define THREADS 4 /* the pool: 3 helpers, whatever the machine */
#define N 5000

typedef struct counts {
    atomic_int c[N];
} counts;

static void count_item(void *arg, int i)
{
    atomic_fetch_add(&((counts *)arg)->c[i], 1);
}

static void *caller_main(void *arg)
{
    for (int rep = 0; rep < 20; rep++)
        kvd__par_for(N, THREADS, count_item, arg);
    return NULL;
}

static void test_each_once(void)
{
    counts *cs = calloc(4, sizeof *cs);
    pthread_t t[4];
    for (int k = 0; k < 4; k++)
        pthread_create(&t[k], NULL, caller_main, &cs[k]);
    for (int k = 0; k < 4; k++)
        pthread_join(t[k], NULL);
    int bad = 0;
    for (int k = 0; k < 4; k++)
        for (int i = 0; i < N; i++)
            bad += atomic_load(&cs[k].c[i]) != 20;
    CHECK(bad == 0);
    free(cs);
}

/* Item 0 holds its thread (up to 10 s) until another thread has run an
 * item: the thread running item 0 runs nothing else meanwhile. */
static _Thread_local int in_item0;
static atomic_int other;

static void helped_item(void *arg, int i)
{
    (void)arg;
    if (i == 0) {
        in_item0 = 1;
        for (int ms = 0; ms < 10000 && !atomic_load(&other); ms++)
            usleep(1000);
        in_item0 = 0;
        return;
    }
    if (!in_item0)
        atomic_store(&other, 1);
    usleep(100);
}

static void test_helped(void)
{
    kvd__par_for(64, THREADS, helped_item, NULL);
    CHECK(atomic_load(&other) == 1);
    CHECK(kvd__par_pool_threads() == THREADS - 1);
}

/* Items that hold their thread until the gate opens. */
static pthread_mutex_t gmu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t gcv = PTHREAD_COND_INITIALIZER;
static int gate_open, entered;

static void gated_item(void *arg, int i)
{
    (void)arg;
    (void)i;
    pthread_mutex_lock(&gmu);
    entered++;
    pthread_cond_broadcast(&gcv);
    while (!gate_open)
        pthread_cond_wait(&gcv, &gmu);
    pthread_mutex_unlock(&gmu);
}

static void *gated_main(void *arg)
{
    (void)arg;
    kvd__par_for(THREADS, THREADS, gated_item, NULL);
    return NULL;
}

static void test_never_waits_for_busy_helpers(void)
{
    pthread_t t;
    pthread_create(&t, NULL, gated_main, NULL);
    /* the job's caller and every helper inside an item */
    pthread_mutex_lock(&gmu);
    while (entered < THREADS)
        pthread_cond_wait(&gcv, &gmu);
    pthread_mutex_unlock(&gmu);
    counts *c = calloc(1, sizeof *c);
    kvd__par_for(N, THREADS, count_item, c); /* returns: its caller did it all */
    int bad = 0;
    for (int i = 0; i < N; i++)
        bad += atomic_load(&c->c[i]) != 1;
    CHECK(bad == 0);
    free(c);
    pthread_mutex_lock(&gmu);
    gate_open = 1;
    pthread_cond_broadcast(&gcv);
    pthread_mutex_unlock(&gmu);
    pthread_join(t, NULL);
}

int main(void)
{
    alarm(60); /* a caller waiting for a busy helper hangs: fail instead */
    kvd__par_size(THREADS);
    test_helped();
    test_each_once();
    test_never_waits_for_busy_helpers();
    if (failures) {
        fprintf(stderr, "%d check(s) failed\n", failures);
        return 1;
    }
    printf("par: all checks passed\n");
    return 0;
}
