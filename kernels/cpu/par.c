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
 *
 * Slots: at most `slots` threads compute at once, callers and helpers
 * together (kvd_cpu_options.slots: by default one more than the CPUs, as a
 * thread a slot is handed to takes a while to be woken, and the one more
 * keeps the CPUs busy meanwhile; with exactly as many, 16 % of the CPU time
 * of four clients' Attend calls went idle). A caller beyond them waits, and
 * the slots go first to the task that ranks least: by the computing it has
 * done since kvd_cpu_task_begin (least attained service) or expects
 * (kvd_cpu_task_expect), whichever is more, up to LONG; tasks ranked LONG
 * go in the order they began. A thread holding a slot gives it up between
 * two items when a waiting task ranks QUANTUM ahead of its own, and waits
 * in turn, and so between two steps of an item's own loops (an item can be
 * a whole query over 32K tokens, ~10 ms; its kv heads are the steps). So a
 * short request (a decode step) that arrives while long ones (batches over
 * 32K tokens) fill the CPUs starts after one step of theirs, rather than
 * sharing the CPUs with all of them for its whole length, and the long ones
 * finish in the order they came rather than all together.
 *
 * Background lane: a task already ranked long when it calls kvd__par_for,
 * and that finds other work in the pool, computes none of it on its own
 * thread. Its items go to background helpers, as many as the CPUs, the
 * oldest such task's first; the caller sleeps until they are done. So on a
 * busy machine the OS too runs short requests' threads (their computing,
 * and the gRPC threads that carry them) ahead of long ones', which the
 * slots alone cannot do: a slot holder the OS has put aside keeps its slot.
 * Alone in the pool, a long task computes as any other (handing a job over
 * costs the helpers' wake-ups, about 8 % of a lone client's INT2 batch).
 *
 * By default the background helpers run under SCHED_IDLE (BG_IDLE): any
 * other thread of the process that wakes up takes their CPU at once, where
 * a nice value only weighs their share and lets them run out their time
 * slice first (with 4 clients on 2 CPUs, the decode steps' p99 went from
 * 3-4 x their p50 at nice 10 to 2 x). Or, kvd__par_background_nice 1..19,
 * a nice value that much above the process's. Neither needs a privilege:
 * a thread may always lower its own priority. Background helpers hold
 * slots like any helper and give them up between items and steps; as the
 * OS may keep a SCHED_IDLE helper aside for as long as other threads want
 * the CPUs, a short task does not wait for those for ever (slot_take).
 */
#include "common/cpu_internal.h"

#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "kvdepot/backend.h"

/* A holder yields to a waiter that ranks this much (ns) ahead of it. */
#define QUANTUM 2000000
/* A short task waits at most this long (ns) for the slot of a background
 * helper that does not move (slot_take). */
#define STEAL 4000000
/* A long task's caller computes its items itself when background helpers
 * that hold slots have not moved for this long (ns) while the process
 * computed less than half a CPU (par_background). */
#define STARVE 200000000
/* A lane that went off for starving is tried again this long (ns) later;
 * each time it starves again within as long as it was off, twice as long
 * (up to RETRY_MAX). A try costs the long task that makes it: it waits
 * STARVE, and for the items its helpers took until the OS runs them
 * (up to 1.9 s measured with two busy processes beside). */
#define RETRY 30000000000LL
#define RETRY_MAX 1920000000000LL
/* Beyond this much computing (ns) a task is long: the long rank alike. */
#define LONG 20000000
/* kvd_cpu_task_expect: the bytes a task reads per ns of computing. */
#define EXPECT_BYTES_PER_NS 2
/* kvd__par_background_nice's value for SCHED_IDLE, the default. */
#define BG_IDLE 20

typedef struct par_job {
    kvd__par_fn fn;
    void *arg;
    int n;
    int max_helpers;     /* threads - 1; threads in the background (its caller computes none) */
    int64_t served0, t0; /* its caller's task: computed before the job, and when the job began */
    int64_t expect;      /* and the computing it expected (kvd_cpu_task_expect) */
    int64_t begun;       /* and when it began */
    int outer;           /* the caller's outermost kvd__par_for: it waits without its slot */
    int bg;              /* run by background helpers only */
    atomic_int next;     /* the next item to take */
    int helpers;         /* helpers inside (under mu) */
    struct par_job *nxt; /* in the list of jobs with items left (under mu) */
} par_job;

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t work = PTHREAD_COND_INITIALIZER;    /* a job was added */
static pthread_cond_t left; /* a helper left a job (left_init: on the monotonic clock) */
static pthread_cond_t bg_work = PTHREAD_COND_INITIALIZER; /* a background job, or a slot, is free */
static par_job *jobs;
static int idle;              /* helpers waiting for work */
static int pool_threads;      /* helpers started */
static int bg_idle;           /* background helpers waiting for work */
static int bg_threads;        /* background helpers started */
static int bg_nice = BG_IDLE; /* < 0: no background lane; 1..19 or BG_IDLE */
static int cpus;              /* threads one op may use: the most a backend asked for */
static int slots;             /* threads that may compute at once (kvd__par_size) */
static int computing;         /* slots held: callers inside kvd__par_for and helpers inside a job */
static int bg_slots;          /* slots held by background helpers */
static atomic_long bg_starvations; /* times the lane went off: its helpers were kept aside */
static int bg_setting = BG_IDLE;   /* the lane as set: bg_nice but while it has starved */
static int64_t bg_retry = RETRY;   /* the next pause of a lane that starves */
static int64_t bg_back_at;         /* when a starved lane is tried again */
static int64_t bg_on_since;        /* when it was last tried again */

/* A condition variable whose timed waits run on the monotonic clock. */
static void cond_init_monotonic(pthread_cond_t *cv)
{
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(cv, &ca);
    pthread_condattr_destroy(&ca);
}

/* A caller waiting for a slot; the list is ordered by key, least first. */
typedef struct par_waiter {
    int64_t key;   /* its task's rank (rank()) */
    int64_t begun; /* when its task began: the order among equal keys */
    int granted;   /* a slot was handed over to it */
    pthread_cond_t cv;
    struct par_waiter *nxt;
} par_waiter;
static par_waiter *waiters;
static atomic_llong head_key = INT64_MAX; /* waiters->key, INT64_MAX when none */
static atomic_int lent;      /* computing > slots: a task took a background helper's slot */
static atomic_llong bg_beat; /* when a background helper last passed an item or a step */

static _Thread_local int depth;        /* > 0: this thread holds a slot (or helps) */
static _Thread_local int64_t served;   /* ns this thread's task computed, slot by slot */
static _Thread_local int64_t t_slot;   /* when it took the slot it holds */
static _Thread_local int64_t begun;    /* when its task began (0: never said) */
static _Thread_local int64_t expect;   /* ns of computing its task expects */
static _Thread_local par_job *helping; /* a helper: the job whose items it runs */

static int64_t clock_ns(clockid_t clock)
{
    struct timespec ts;
    clock_gettime(clock, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static int64_t now_ns(void)
{
    return clock_ns(CLOCK_MONOTONIC);
}

static int64_t process_cpu_ns(void)
{
    return clock_ns(CLOCK_PROCESS_CPUTIME_ID);
}

void kvd_cpu_task_begin(void)
{
    served = 0;
    expect = 0;
    begun = now_ns();
    if (depth)
        t_slot = begun;
}

void kvd_cpu_task_expect(uint64_t bytes)
{
    const uint64_t ns = bytes / EXPECT_BYTES_PER_NS;
    expect = ns < LONG ? (int64_t)ns : LONG;
}

/* A task's rank: the computing it did or expects, whichever is more, at
 * most LONG. */
static int64_t rank(int64_t ns, int64_t expected)
{
    if (ns < expected)
        ns = expected;
    return ns < LONG ? ns : LONG;
}

/* A background job has items left (under mu). */
static int bg_items_left(void)
{
    for (const par_job *j = jobs; j; j = j->nxt)
        if (j->bg && atomic_load_explicit(&j->next, memory_order_relaxed) < j->n)
            return 1;
    return 0;
}

/* Give a slot up: to the first waiter, or free (under mu): a background
 * helper may then go on with a job it left to a waiter. */
static void slot_release(void)
{
    par_waiter *w = waiters;
    if (!w) {
        computing--;
        atomic_store_explicit(&lent, computing > slots, memory_order_relaxed);
        if (bg_idle && bg_items_left())
            pthread_cond_signal(&bg_work);
        return;
    }
    waiters = w->nxt;
    atomic_store_explicit(&head_key, waiters ? waiters->key : INT64_MAX, memory_order_relaxed);
    w->granted = 1;
    pthread_cond_signal(&w->cv);
}

/* Take a slot beyond the count, in place of a background helper's (under
 * mu): the helpers give theirs back at their next item or step. */
static void slot_borrow(void)
{
    computing++;
    atomic_store_explicit(&lent, computing > slots, memory_order_relaxed);
}

/* Take a slot, waiting in the order of key (a rank) and then of when the
 * task began while all are held (under mu). Background helpers give their
 * slots up to a waiter that outranks them between two items or steps; but
 * under SCHED_IDLE the OS keeps them aside for as long as other threads of
 * the process want the CPUs, and a waiter could wait as long (the better
 * part of a second was seen with 16 clients). So a task not ranked long
 * that has waited STEAL while background helpers hold slots, none of which
 * has passed an item or a step for as long, takes one anyway: one more
 * thread computes than there are slots until a background helper gives
 * its slot back at its next item or step. (Taken sooner, or while they are
 * running, it made the slowest decode steps slower: more threads compute
 * at the normal priority.) */
static void slot_take(int64_t key, int64_t task_begun)
{
    if ((computing < slots || slots == 0) && !waiters) { /* 0: no backend said */
        computing++;
        return;
    }
    par_waiter w = {.key = key, .begun = task_begun};
    cond_init_monotonic(&w.cv);
    par_waiter **p = &waiters;
    while (*p && ((*p)->key < w.key || ((*p)->key == w.key && (*p)->begun <= w.begun)))
        p = &(*p)->nxt;
    w.nxt = *p;
    *p = &w;
    atomic_store_explicit(&head_key, waiters->key, memory_order_relaxed);
    const int64_t until = now_ns() + STEAL;
    while (!w.granted) {
        if (key >= LONG || bg_slots == 0) {
            pthread_cond_wait(&w.cv, &mu);
            continue;
        }
        const int64_t beat = atomic_load_explicit(&bg_beat, memory_order_relaxed) + STEAL;
        const int64_t at = beat > until ? beat : until;
        const struct timespec ts = {at / 1000000000, at % 1000000000};
        if (pthread_cond_timedwait(&w.cv, &mu, &ts) == ETIMEDOUT && !w.granted && bg_slots > 0 &&
            now_ns() - atomic_load_explicit(&bg_beat, memory_order_relaxed) >= STEAL) {
            for (p = &waiters; *p != &w; p = &(*p)->nxt)
                ;
            *p = w.nxt;
            atomic_store_explicit(&head_key, waiters ? waiters->key : INT64_MAX,
                                  memory_order_relaxed);
            slot_borrow();
            break;
        }
    }
    pthread_cond_destroy(&w.cv);
}

/* A waiter ranks QUANTUM ahead of a task that has computed ns: cheap, no
 * lock. */
static int outranked(int64_t ns, int64_t expected)
{
    const int64_t h = atomic_load_explicit(&head_key, memory_order_relaxed);
    return h != INT64_MAX && h + QUANTUM < rank(ns, expected);
}

/* Between two items or steps of a slot holder's work: hand the slot to a
 * waiter that ranks QUANTUM ahead, and wait for it again. A caller ranks
 * by its own task, a helper by the task of the job it helps. A helper waits
 * so only inside an outermost job, whose caller gave its slot up to wait
 * for it: the caller of a nested job keeps its slot meanwhile, and a helper
 * of one waiting for a slot could wait for ever. */
static void maybe_yield(void)
{
    const par_job *j = helping;
    if (j && !j->outer)
        return;
    const int bg = j && j->bg;
    int64_t t = 0;
    if (bg) {
        t = now_ns();
        atomic_store_explicit(&bg_beat, t, memory_order_relaxed);
    }
    /* a background helper whose slot a short task took: give it back */
    const int give_back = bg && atomic_load_explicit(&lent, memory_order_relaxed);
    if (!give_back && atomic_load_explicit(&head_key, memory_order_relaxed) == INT64_MAX)
        return;
    if (!bg)
        t = now_ns();
    const int64_t ns = j ? j->served0 + (t - j->t0) : served + (t - t_slot);
    const int64_t exp = j ? j->expect : expect;
    if (!give_back && !outranked(ns, exp))
        return;
    pthread_mutex_lock(&mu);
    if ((waiters && waiters->key + QUANTUM < rank(ns, exp)) || (bg && computing > slots)) {
        if (!j)
            served = ns;
        bg_slots -= bg;
        slot_release();
        slot_take(rank(ns, exp), j ? j->begun : begun);
        bg_slots += bg;
        if (!j)
            t_slot = now_ns();
    }
    pthread_mutex_unlock(&mu);
}

/* The outermost kvd__par_for of a thread takes a slot for its work. */
static void gate_enter(void)
{
    if (depth++)
        return;
    pthread_mutex_lock(&mu);
    slot_take(rank(served, expect), begun);
    pthread_mutex_unlock(&mu);
    t_slot = now_ns();
}

static void gate_leave(void)
{
    if (--depth)
        return;
    served += now_ns() - t_slot;
    pthread_mutex_lock(&mu);
    slot_release();
    pthread_mutex_unlock(&mu);
}

/* The items of j until none is left; a helper also stops when a waiter
 * ranks QUANTUM ahead of j's task, a caller yields its slot then. */
static void run_items(par_job *j, int helper)
{
    for (int k = 0;; k++) {
        if (k && helper) {
            const int64_t t = now_ns();
            if (j->bg)
                atomic_store_explicit(&bg_beat, t, memory_order_relaxed);
            if (outranked(j->served0 + (t - j->t0), j->expect) ||
                (j->bg && atomic_load_explicit(&lent, memory_order_relaxed)))
                return;
        }
        if (k && !helper)
            maybe_yield();
        int i = atomic_fetch_add_explicit(&j->next, 1, memory_order_relaxed);
        if (i >= j->n)
            return;
        j->fn(j->arg, i);
    }
}

/* A job of the lane bg with items left and room for a helper, or NULL
 * (under mu): the newest, and the oldest task's in the background. A
 * helper joins only while fewer threads compute than there are slots. */
static par_job *pick(int bg)
{
    if (computing >= slots || waiters)
        return NULL;
    par_job *best = NULL;
    for (par_job *j = jobs; j; j = j->nxt)
        if (j->bg == bg && j->helpers < j->max_helpers &&
            atomic_load_explicit(&j->next, memory_order_relaxed) < j->n) {
            if (!bg)
                return j;
            if (!best || j->begun < best->begun)
                best = j;
        }
    return best;
}

/* A background helper's priority for the lane's setting `mode` (BG_IDLE,
 * or a nice value above the process's: base, its nice at the start), best
 * effort: a failure leaves it where it was. Lowering is always allowed;
 * going back up (a setting changed while helpers exist: tests) only with
 * the privilege to. */
static void bg_priority(int mode, int base)
{
    const id_t me = (id_t)syscall(SYS_gettid);
    struct sched_param sp = {0};
    if (mode == BG_IDLE) {
        (void)sched_setscheduler(0, SCHED_IDLE, &sp);
        return;
    }
    if (sched_getscheduler(0) != SCHED_OTHER)
        (void)sched_setscheduler(0, SCHED_OTHER, &sp);
    (void)setpriority(PRIO_PROCESS, me, base + mode < 19 ? base + mode : 19);
}

/* A helper; a background one (arg not NULL) sets its priority for the
 * lane's setting before its first job and whenever the setting changed. */
static void *helper_main(void *arg)
{
    const int bg = arg != NULL;
    int base = 0, mode = 0; /* the process's nice; the setting applied (0: none yet) */
    if (bg) {
        errno = 0;
        base = getpriority(PRIO_PROCESS, (id_t)syscall(SYS_gettid));
        if (errno)
            base = 0;
    }
    pthread_mutex_lock(&mu);
    for (;;) {
        par_job *j = pick(bg);
        if (!j) {
            int *n_idle = bg ? &bg_idle : &idle;
            (*n_idle)++;
            pthread_cond_wait(bg ? &bg_work : &work, &mu);
            (*n_idle)--;
            continue;
        }
        if (bg && bg_nice > 0 && mode != bg_nice) {
            mode = bg_nice;
            bg_priority(mode, base);
        }
        j->helpers++;
        computing++;
        bg_slots += bg;
        if (bg)
            atomic_store_explicit(&bg_beat, now_ns(), memory_order_relaxed);
        pthread_mutex_unlock(&mu);
        depth = 1; /* an item's own kvd__par_for runs in this slot */
        helping = j;
        run_items(j, 1);
        helping = NULL;
        depth = 0;
        pthread_mutex_lock(&mu);
        bg_slots -= bg;
        slot_release();
        if (--j->helpers == 0)
            pthread_cond_broadcast(&left);
    }
    return NULL;
}

void kvd__par_size(int threads, int nslots)
{
    pthread_mutex_lock(&mu);
    if (threads > cpus)
        cpus = threads > 256 ? 256 : threads;
    if (nslots < cpus)
        nslots = cpus;
    if (nslots > slots)
        slots = nslots > 1024 ? 1024 : nslots;
    while (waiters && computing < slots) { /* the new slots, to the first waiters */
        computing++;
        slot_release();
    }
    pthread_mutex_unlock(&mu);
}

void kvd__par_background_nice(int nice)
{
    pthread_mutex_lock(&mu);
    bg_nice = bg_setting = nice < 0 ? -1 : nice == 0 || nice >= BG_IDLE ? BG_IDLE : nice;
    bg_retry = RETRY;
    bg_on_since = 0;
    pthread_mutex_unlock(&mu);
}

void kvd__par_background_retry(int64_t ns)
{
    pthread_mutex_lock(&mu);
    bg_retry = ns > 0 ? ns : RETRY;
    pthread_mutex_unlock(&mu);
}

int kvd_cpu_background_starved(void)
{
    pthread_mutex_lock(&mu);
    const int off = bg_nice != bg_setting;
    pthread_mutex_unlock(&mu);
    return off;
}

long kvd_cpu_background_starvations(void)
{
    return atomic_load_explicit(&bg_starvations, memory_order_relaxed);
}

/* Start helpers of a lane up to want (under mu); the number running. */
static int grow(int *started, int want, int bg)
{
    while (*started < want) {
        pthread_attr_t at;
        pthread_t t;
        pthread_attr_init(&at);
        pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
        const int rc = pthread_create(&t, &at, helper_main, bg ? &bg_work : NULL);
        pthread_attr_destroy(&at);
        if (rc != 0)
            break; /* the callers compute alone */
        (*started)++;
    }
    return *started;
}

/* Helpers up to cpus - 1 (under mu); the number running. */
static int grow_pool(void)
{
    return grow(&pool_threads, cpus - 1, 0);
}

int kvd__par_pool_threads(void)
{
    pthread_mutex_lock(&mu);
    int n = pool_threads;
    pthread_mutex_unlock(&mu);
    return n;
}

static void run_serial(int n, kvd__par_fn fn, void *arg)
{
    for (int i = 0; i < n; i++) {
        if (i)
            maybe_yield();
        fn(arg, i);
    }
}

/* The outermost kvd__par_for of a task ranked long: every item on the
 * background helpers, the caller waiting without a slot; 0 when none could
 * start (the caller computes then). */
static int par_background(int n, int threads, kvd__par_fn fn, void *arg)
{
    par_job j = {.fn = fn,
                 .arg = arg,
                 .n = n,
                 .max_helpers = threads > 1 ? threads : 1,
                 .served0 = served,
                 .expect = expect,
                 .begun = begun,
                 .outer = 1,
                 .bg = 1};
    atomic_init(&j.next, 0);
    j.t0 = now_ns();
    pthread_mutex_lock(&mu);
    if (bg_nice != bg_setting && j.t0 >= bg_back_at) {
        /* what kept the helpers aside may have gone: the lane is tried
         * again (a lane that starves again goes off again, as below) */
        bg_nice = bg_setting;
        bg_on_since = j.t0;
    }
    /* Alone in the pool, it computes as any task does (a job handed over
     * costs its helpers' wake-ups, and there is nothing to give way to). */
    if ((computing == 0 && !jobs) || bg_nice < 0 || grow(&bg_threads, cpus, 1) == 0) {
        pthread_mutex_unlock(&mu);
        return 0;
    }
    j.nxt = jobs;
    jobs = &j;
    int wake = j.max_helpers < n ? j.max_helpers : n;
    if (wake > slots - computing)
        wake = slots - computing;
    for (int w = 0; w < wake && w < bg_idle; w++)
        pthread_cond_signal(&bg_work);
    /* the helpers' last sign of life seen, since when, and the process's
     * CPU time then */
    int64_t seen = atomic_load_explicit(&bg_beat, memory_order_relaxed), t_win = now_ns(),
            cpu_win = process_cpu_ns();
    while (atomic_load_explicit(&j.next, memory_order_relaxed) < n || j.helpers) {
        if (atomic_load_explicit(&j.next, memory_order_relaxed) >= n) {
            pthread_cond_wait(&left, &mu);
            continue;
        }
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts); /* left's clock */
        ts.tv_nsec += STARVE / 4;
        ts.tv_sec += ts.tv_nsec / 1000000000;
        ts.tv_nsec %= 1000000000;
        pthread_cond_timedwait(&left, &mu, &ts);
        if (bg_slots == 0 || atomic_load_explicit(&j.next, memory_order_relaxed) >= n)
            continue;
        const int64_t beat = atomic_load_explicit(&bg_beat, memory_order_relaxed), t = now_ns();
        if (beat != seen || t - t_win < STARVE) {
            if (beat != seen) {
                seen = beat;
                t_win = t;
                cpu_win = process_cpu_ns();
            }
            continue;
        }
        /* No background helper has moved for STARVE. Kept aside by the
         * process's own threads (short requests), as meant, the process
         * computed meanwhile; if it did not, something else had the CPUs. */
        const int64_t cpu = process_cpu_ns();
        if (cpu - cpu_win >= (t - t_win) / 2) {
            t_win = t;
            cpu_win = cpu;
            continue;
        }
        /* Background helpers hold slots and do not move, while the
         * process hardly computes: the OS keeps them aside for other
         * processes, as it does a SCHED_IDLE thread for as long as
         * other threads of its group (processes in the session or
         * cgroup) want the CPUs. The caller computes the items left at
         * its own priority, taking a slot the way a short task does
         * past STEAL (slot_take), and the lane goes off: later long
         * tasks compute on their own threads, as with it off, until the
         * lane is tried again (RETRY later, twice as long each time it
         * starves again within as long as it was off). The items the
         * helpers hold finish when the OS runs them. */
        if (bg_nice >= 0) {
            bg_nice = -1;
            atomic_fetch_add_explicit(&bg_starvations, 1, memory_order_relaxed);
            if (bg_on_since && t - bg_on_since <= bg_retry)
                bg_retry = bg_retry * 2 < RETRY_MAX ? bg_retry * 2 : RETRY_MAX;
            bg_back_at = t + bg_retry;
        }
        slot_borrow();
        pthread_mutex_unlock(&mu);
        depth = 1;
        t_slot = now_ns();
        run_items(&j, 0);
        depth = 0;
        pthread_mutex_lock(&mu);
        slot_release();
    }
    for (par_job **p = &jobs; *p; p = &(*p)->nxt)
        if (*p == &j) {
            *p = j.nxt;
            break;
        }
    pthread_mutex_unlock(&mu);
    served += now_ns() - j.t0;
    return 1;
}

/* `left` takes timed waits (a long task's starvation guard): on the
 * monotonic clock, so that the wall clock set back cannot stretch them. */
static pthread_once_t left_once = PTHREAD_ONCE_INIT;
static void left_init(void)
{
    cond_init_monotonic(&left);
}

void kvd__par_for(int n, int threads, kvd__par_fn fn, void *arg)
{
    if (n <= 0)
        return;
    pthread_once(&left_once, left_init); /* before any use of left: helpers start below */
    const int outer = depth == 0;
    if (outer && rank(served, expect) >= LONG && par_background(n, threads, fn, arg))
        return;
    gate_enter();
    if (n == 1 || threads <= 1) {
        run_serial(n, fn, arg);
        gate_leave();
        return;
    }
    par_job j = {.fn = fn,
                 .arg = arg,
                 .n = n,
                 .max_helpers = threads - 1,
                 .begun = begun,
                 .outer = outer,
                 .bg = helping && helping->bg}; /* a background item's own job stays there */
    atomic_init(&j.next, 0);
    j.t0 = now_ns();
    j.served0 = served + (j.t0 - t_slot);
    j.expect = expect;
    pthread_mutex_lock(&mu);
    if (grow_pool() == 0) { /* no helper could start */
        pthread_mutex_unlock(&mu);
        run_serial(n, fn, arg);
        gate_leave();
        return;
    }
    j.nxt = jobs;
    jobs = &j;
    int wake = j.max_helpers < n - 1 ? j.max_helpers : n - 1;
    if (wake > (j.bg ? bg_idle : idle))
        wake = j.bg ? bg_idle : idle;
    if (wake > slots - computing)
        wake = slots - computing > 0 ? slots - computing : 0;
    for (int w = 0; w < wake; w++)
        pthread_cond_signal(j.bg ? &bg_work : &work);
    pthread_mutex_unlock(&mu);

    run_items(&j, 0);

    /* No helper joins once the job is off the list; wait for those in it
     * to finish the items they took, the caller's slot given up meanwhile
     * (an item's own kvd__par_for keeps its slot). */
    if (outer)
        served += now_ns() - t_slot;
    pthread_mutex_lock(&mu);
    for (par_job **p = &jobs; *p; p = &(*p)->nxt)
        if (*p == &j) {
            *p = j.nxt;
            break;
        }
    if (outer)
        slot_release();
    while (j.helpers)
        pthread_cond_wait(&left, &mu);
    pthread_mutex_unlock(&mu);
    depth--;
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
    par_ranges r = {fn, arg, n, parts <= 1 ? n : (n + parts - 1) / parts};
    kvd__par_for((int)((n + r.per - 1) / r.per), threads, range_item, &r);
}
