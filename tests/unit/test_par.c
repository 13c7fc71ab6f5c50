/*
 * The process's compute pool (kernels/cpu/par.c, kvd__par_for):
 *
 *  - every item runs exactly once, with several callers at the same time;
 *  - a caller alone gets help: its items run on more than one thread;
 *  - a caller never waits for a helper that is busy elsewhere: with every
 *    helper held inside another job, a job still finishes, on its caller
 *    alone (an OpenMP team would wait for its threads at the barrier; here
 *    that would hang, and the alarm fails the test);
 *  - no more threads run items at once than there are slots;
 *  - a new task (kvd_cpu_task_begin) that finds every slot held by tasks
 *    that have computed longer gets a slot between two of their items: it
 *    finishes while each of them still has work left;
 *  - a task ranked long (kvd_cpu_task_expect) that finds another computing
 *    hands its items to the background helpers, which run at a lower
 *    priority (SCHED_IDLE by default, or a nice value above the caller's:
 *    kvd__par_background_nice), and computes none itself; alone, or with
 *    the lane off (kvd__par_background_nice(-1)), it computes them too;
 *  - new tasks, as many as the background helpers, that find every slot
 *    held by those helpers and a short task get slots before the long
 *    tasks finish, and the long tasks still finish, every item once: the
 *    helpers that gave their slots up go on once the slots are free again;
 *  - a short task that finds every slot held, background helpers among the
 *    holders, does not wait for them: background helpers that never reach
 *    the end of an item (as the OS may keep a SCHED_IDLE thread aside) do
 *    not keep it from finishing;
 *  - nor do they keep their own long task from finishing the items they
 *    have not taken: its caller computes those, and the lane goes off
 *    (kvd_cpu_background_starved) until a long task tries it again after
 *    a pause, twice as long each time it starves again soon after, or it
 *    is set again.
 */
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "common/cpu_internal.h"
#include "kvdepot/backend.h"

static int failures;
#define CHECK(cond)                                                                                \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond);               \
            failures++;                                                                            \
        }                                                                                          \
    } while (0)

#define THREADS 4 /* the pool: 3 helpers, whatever the machine */
#define SLOTS 5   /* threads computing at once: a caller beside a full job */
#define N 5000

typedef struct counts {
    atomic_int c[N];
} counts;

static void count_item(void *arg, int i)
{
    atomic_fetch_add(&((counts *)arg)->c[i], 1);
}

static void count_range(void *arg, int64_t lo, int64_t hi)
{
    for (int64_t i = lo; i < hi; i++)
        count_item(arg, (int)i);
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
    kvd_cpu_task_begin();                    /* not ranked long: no background lane */
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

/* Threads inside an item now, and the most seen. */
static atomic_int inside, most_inside;

static void busy_item(void *arg, int i)
{
    (void)arg;
    (void)i;
    int now = atomic_fetch_add(&inside, 1) + 1;
    for (int m = atomic_load(&most_inside);
         now > m && !atomic_compare_exchange_weak(&most_inside, &m, now);)
        ;
    usleep(50);
    atomic_fetch_sub(&inside, 1);
}

static void *busy_main(void *arg)
{
    kvd__par_for(200, (int)(intptr_t)arg, busy_item, NULL);
    return NULL;
}

static void test_slots_bound(void)
{
    pthread_t t[2 * SLOTS];
    for (int k = 0; k < 2 * SLOTS; k++) /* serial callers and callers with helpers */
        pthread_create(&t[k], NULL, busy_main, (void *)(intptr_t)(k % 2 ? THREADS : 1));
    for (int k = 0; k < 2 * SLOTS; k++)
        pthread_join(t[k], NULL);
    CHECK(atomic_load(&most_inside) >= 2); /* they did overlap */
    CHECK(atomic_load(&most_inside) <= SLOTS);
}

#define LONG_TASKS (SLOTS + 3) /* three of them wait for a slot at any time */
#define LONG_ITEMS 500
static atomic_int long_done[LONG_TASKS];

static void long_item(void *arg, int i)
{
    (void)i;
    usleep(200);
    atomic_fetch_add((atomic_int *)arg, 1);
}

static void *long_main(void *arg)
{
    kvd_cpu_task_begin();
    kvd__par_for(LONG_ITEMS, 1, long_item, arg);
    return NULL;
}

static void test_least_served_first(void)
{
    pthread_t t[LONG_TASKS];
    for (int k = 0; k < LONG_TASKS; k++)
        pthread_create(&t[k], NULL, long_main, &long_done[k]);
    /* every long task has computed a while (some wait for a slot now) */
    for (int k = 0; k < LONG_TASKS; k++)
        while (atomic_load(&long_done[k]) < 20)
            usleep(1000);
    atomic_int mine = 0;
    kvd_cpu_task_begin();
    kvd__par_for(5, 1, long_item, &mine);
    int finished = 0;
    for (int k = 0; k < LONG_TASKS; k++)
        finished += atomic_load(&long_done[k]) == LONG_ITEMS;
    CHECK(atomic_load(&mine) == 5);
    CHECK(finished == 0); /* it did not wait for a whole long task */
    for (int k = 0; k < LONG_TASKS; k++)
        pthread_join(t[k], NULL);
}

/* A short task holding a slot until told to let go. */
static atomic_int holding, let_go;

static void hold_item(void *arg, int i)
{
    (void)arg;
    (void)i;
    atomic_store(&holding, 1);
    while (!atomic_load(&let_go))
        usleep(500);
}

static void *holder_main(void *arg)
{
    (void)arg;
    kvd_cpu_task_begin();
    kvd__par_for(1, 1, hold_item, NULL);
    return NULL;
}

static void hold_start(pthread_t *t)
{
    atomic_store(&holding, 0);
    atomic_store(&let_go, 0);
    pthread_create(t, NULL, holder_main, NULL);
    while (!atomic_load(&holding))
        usleep(500);
}

static void hold_end(pthread_t t)
{
    atomic_store(&let_go, 1);
    pthread_join(t, NULL);
}

static long tid(void)
{
    return (long)syscall(SYS_gettid);
}

#define LANE_ITEMS 64
typedef struct lane {
    atomic_int c[LANE_ITEMS];
    atomic_int on_caller, lowered, idled;
    long caller;
    int nice; /* the caller's */
} lane;

static void lane_item(void *arg, int i)
{
    lane *l = arg;
    atomic_fetch_add(&l->c[i], 1);
    const long me = tid();
    if (me == l->caller)
        atomic_fetch_add(&l->on_caller, 1);
    errno = 0;
    const int nice = getpriority(PRIO_PROCESS, (id_t)me);
    if (errno == 0 && nice > l->nice)
        atomic_fetch_add(&l->lowered, 1);
    if (sched_getscheduler(0) == SCHED_IDLE)
        atomic_fetch_add(&l->idled, 1);
    usleep(200);
}

/* A task ranked long from its start runs LANE_ITEMS items. */
static void *lane_main(void *arg)
{
    lane *l = arg;
    l->caller = tid();
    l->nice = getpriority(PRIO_PROCESS, (id_t)l->caller);
    kvd_cpu_task_begin();
    kvd_cpu_task_expect((uint64_t)1 << 32);
    kvd__par_for(LANE_ITEMS, THREADS, lane_item, l);
    return NULL;
}

static int lane_bad(lane *l)
{
    int bad = 0;
    for (int i = 0; i < LANE_ITEMS; i++)
        bad += atomic_load(&l->c[i]) != 1;
    return bad;
}

/* A long task beside another computing: its items on the background
 * helpers only. */
static void run_lane(lane *l)
{
    pthread_t t, h;
    memset(l, 0, sizeof *l);
    hold_start(&h); /* another task computes */
    pthread_create(&t, NULL, lane_main, l);
    pthread_join(t, NULL);
    hold_end(h);
    CHECK(lane_bad(l) == 0);
}

static void test_background(void)
{
    lane *l = calloc(1, sizeof *l);
    pthread_t t;
    pthread_create(&t, NULL, lane_main, l); /* alone */
    pthread_join(t, NULL);
    CHECK(lane_bad(l) == 0);
    CHECK(atomic_load(&l->on_caller) > 0);
    /* a nice value first: a helper under SCHED_IDLE may not leave it
     * without the privilege to */
    kvd__par_background_nice(10);
    run_lane(l);
    CHECK(atomic_load(&l->on_caller) == 0);
    CHECK(atomic_load(&l->lowered) == LANE_ITEMS);
    CHECK(atomic_load(&l->idled) == 0);
    kvd__par_background_nice(-1); /* no background lane: on the caller too */
    run_lane(l);
    CHECK(atomic_load(&l->on_caller) > 0);
    kvd__par_background_nice(0); /* the default: SCHED_IDLE */
    run_lane(l);
    CHECK(atomic_load(&l->on_caller) == 0);
    CHECK(atomic_load(&l->idled) == LANE_ITEMS);
    free(l);
}

static void *short_main(void *arg)
{
    kvd_cpu_task_begin();
    kvd__par_for(5, 1, long_item, arg);
    return NULL;
}

static void test_short_before_background(void)
{
    enum { LANES = 3 };
    lane *l = calloc(LANES, sizeof *l);
    pthread_t h, t[LANES];
    hold_start(&h); /* with the background helpers, every slot held */
    for (int k = 0; k < LANES; k++)
        pthread_create(&t[k], NULL, lane_main, &l[k]);
    int started = 0;
    while (!started) {
        usleep(1000);
        for (int i = 0; i < LANE_ITEMS; i++)
            started += atomic_load(&l[0].c[i]);
    }
    atomic_int mine[THREADS];
    pthread_t st[THREADS];
    for (int k = 0; k < THREADS; k++) {
        atomic_init(&mine[k], 0);
        pthread_create(&st[k], NULL, short_main, &mine[k]);
    }
    for (int k = 0; k < THREADS; k++)
        pthread_join(st[k], NULL);
    int finished = 0;
    for (int k = 0; k < LANES; k++) {
        int done = 0;
        for (int i = 0; i < LANE_ITEMS; i++)
            done += atomic_load(&l[k].c[i]);
        finished += done == LANE_ITEMS;
    }
    for (int k = 0; k < THREADS; k++)
        CHECK(atomic_load(&mine[k]) == 5);
    CHECK(finished < LANES); /* they did not wait for every long task */
    for (int k = 0; k < LANES; k++) {
        pthread_join(t[k], NULL);
        CHECK(lane_bad(&l[k]) == 0);
    }
    hold_end(h);
    free(l);
}

/* Background items that stay inside until let out: a helper the OS keeps
 * aside. */
static atomic_int stuck_in, unstick;

static void stuck_item(void *arg, int i)
{
    lane *l = arg;
    atomic_fetch_add(&l->c[i], 1);
    atomic_fetch_add(&stuck_in, 1);
    while (!atomic_load(&unstick))
        usleep(200);
}

static void *stuck_main(void *arg)
{
    kvd_cpu_task_begin();
    kvd_cpu_task_expect((uint64_t)1 << 32);
    kvd__par_for(LANE_ITEMS, THREADS, stuck_item, arg);
    return NULL;
}

typedef struct short_run {
    atomic_int n, done;
} short_run;

static void *short_done_main(void *arg)
{
    short_run *r = arg;
    kvd_cpu_task_begin();
    kvd__par_for(5, 1, long_item, &r->n);
    atomic_store(&r->done, 1);
    return NULL;
}

static void test_short_takes_background_slot(void)
{
    lane *l = calloc(1, sizeof *l);
    short_run r;
    atomic_init(&r.n, 0);
    atomic_init(&r.done, 0);
    pthread_t h, t, s;
    hold_start(&h); /* with the background helpers below, every slot held */
    pthread_create(&t, NULL, stuck_main, l);
    while (atomic_load(&stuck_in) < THREADS)
        usleep(500);
    pthread_create(&s, NULL, short_done_main, &r);
    for (int ms = 0; ms < 5000 && !atomic_load(&r.done); ms++)
        usleep(1000);
    CHECK(atomic_load(&r.done) == 1); /* while the helpers stayed inside */
    atomic_store(&unstick, 1);
    pthread_join(s, NULL);
    pthread_join(t, NULL);
    hold_end(h);
    CHECK(atomic_load(&r.n) == 5);
    CHECK(lane_bad(l) == 0);
    free(l);
}

/* Items that stay inside on a background helper until let out. */
static void stuck_bg_item(void *arg, int i)
{
    lane *l = arg;
    atomic_fetch_add(&l->c[i], 1);
    if (tid() == l->caller) {
        atomic_fetch_add(&l->on_caller, 1);
        return;
    }
    atomic_fetch_add(&stuck_in, 1);
    while (!atomic_load(&unstick))
        usleep(200);
}

static void *stuck_bg_main(void *arg)
{
    lane *l = arg;
    l->caller = tid();
    kvd_cpu_task_begin();
    kvd_cpu_task_expect((uint64_t)1 << 32);
    kvd__par_for(LANE_ITEMS, THREADS, stuck_bg_item, l);
    return NULL;
}

/* A long task whose background helpers never move: the items they did not
 * take computed on its caller, and the lane goes off. */
static void starve_lane(lane *l)
{
    atomic_store(&stuck_in, 0);
    atomic_store(&unstick, 0);
    memset(l, 0, sizeof *l);
    const long before = kvd_cpu_background_starvations();
    pthread_t h, t;
    hold_start(&h); /* another task computes: the long one goes to the background */
    pthread_create(&t, NULL, stuck_bg_main, l);
    int done = 0;
    for (int ms = 0; ms < 5000 && done < LANE_ITEMS; ms++) {
        usleep(1000);
        done = 0;
        for (int i = 0; i < LANE_ITEMS; i++)
            done += atomic_load(&l->c[i]);
    }
    CHECK(done == LANE_ITEMS); /* the items no helper took: on the caller */
    CHECK(atomic_load(&l->on_caller) > 0);
    CHECK(atomic_load(&l->on_caller) + atomic_load(&stuck_in) == LANE_ITEMS);
    CHECK(kvd_cpu_background_starved() == 1);
    CHECK(kvd_cpu_background_starvations() == before + 1);
    atomic_store(&unstick, 1);
    pthread_join(t, NULL);
    hold_end(h);
    CHECK(lane_bad(l) == 0);
}

static int64_t mono_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* Sleep until `ns` past t0. */
static void sleep_until(int64_t t0, int64_t ns)
{
    int64_t left = t0 + ns - mono_ns();
    if (left > 0)
        usleep((useconds_t)(left / 1000));
}

static void test_starved_background(void)
{
    enum { RETRY_MS = 1000 };
    kvd__par_background_nice(0);
    kvd__par_background_retry((int64_t)RETRY_MS * 1000000);
    CHECK(kvd_cpu_background_starved() == 0);
    lane *l = calloc(1, sizeof *l);
    starve_lane(l);
    int64_t off = mono_ns();
    /* the lane is off: the next long task computes on its caller */
    run_lane(l);
    CHECK(atomic_load(&l->on_caller) > 0);
    CHECK(kvd_cpu_background_starved() == 1);
    /* past the pause, the next long task tries the lane again */
    sleep_until(off, (int64_t)RETRY_MS * 1000000 + 100000000);
    run_lane(l);
    CHECK(atomic_load(&l->on_caller) == 0);
    CHECK(atomic_load(&l->idled) == LANE_ITEMS);
    CHECK(kvd_cpu_background_starved() == 0);
    /* starving again soon after: off twice as long */
    starve_lane(l);
    off = mono_ns();
    sleep_until(off, (int64_t)RETRY_MS * 1000000 + 100000000);
    run_lane(l);
    CHECK(atomic_load(&l->on_caller) > 0);
    CHECK(kvd_cpu_background_starved() == 1);
    sleep_until(off, (int64_t)2 * RETRY_MS * 1000000 + 100000000);
    run_lane(l);
    CHECK(atomic_load(&l->on_caller) == 0);
    CHECK(kvd_cpu_background_starved() == 0);
    /* set again: on at once */
    starve_lane(l);
    kvd__par_background_nice(0);
    CHECK(kvd_cpu_background_starved() == 0);
    run_lane(l);
    CHECK(atomic_load(&l->on_caller) == 0);
    free(l);
}

int main(void)
{
    alarm(60); /* a caller waiting for a busy helper hangs: fail instead */
    /* before any backend has sized the pool: items run, on the caller */
    counts *c0 = calloc(1, sizeof *c0);
    kvd__par_for(N, THREADS, count_item, c0);
    kvd__par_ranges(1, 1, 1, count_range, c0);
    int bad0 = 0;
    for (int i = 0; i < N; i++)
        bad0 += atomic_load(&c0->c[i]) != 1 + (i == 0);
    CHECK(bad0 == 0);
    free(c0);
    kvd__par_size(THREADS, SLOTS);
    test_helped();
    test_each_once();
    test_never_waits_for_busy_helpers();
    test_slots_bound();
    test_least_served_first();
    test_background();
    test_short_before_background();
    test_short_takes_background_slot();
    test_starved_background();
    if (failures) {
        fprintf(stderr, "%d check(s) failed\n", failures);
        return 1;
    }
    printf("par: all checks passed\n");
    return 0;
}
