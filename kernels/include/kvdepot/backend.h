/*
 * The kvdepot compute backend interface.
 *
 * A backend is a table of function pointers plus a context. The table is
 * grouped by op family; each family table is defined in its own header
 * (kvdepot/convert.h, quant.h, kmeans.h, vq.h, pq.h, svd.h, attention.h).
 * A NULL family pointer, or a NULL member inside a family table, means the
 * backend does not support that op: callers go through the checked wrappers
 * declared in the family headers, which validate arguments and return
 * KVD_EUNSUPP for a missing op.
 *
 * Memory: every tensor passed to an op of a backend lives in memory of that
 * backend (host memory for the CPU backend, device memory for CUDA), obtained
 * with kvd_backend_alloc(). Copies between host and backend memory go through
 * kvd_backend_upload()/download(). A backend may run ops asynchronously on its
 * own streams; kvd_backend_sync() waits for everything issued so far. The CPU
 * backend is synchronous and its alloc is an aligned malloc.
 *
 * Interfaces grow only by appending members.
 */
#ifndef KVDEPOT_BACKEND_H
#define KVDEPOT_BACKEND_H

#include <stddef.h>
#include <stdint.h>

#include "kvdepot/status.h"
#include "kvdepot/tensor.h"

typedef struct kvd_backend kvd_backend;

/* Family tables, defined in the family headers. */
struct kvd_convert_ops;
struct kvd_quant_ops;
struct kvd_kmeans_ops;
struct kvd_vq_ops;
struct kvd_pq_ops;
struct kvd_svd_ops;
struct kvd_attn_ops;

/* What a backend runs on, for logs and stats. */
typedef struct kvd_backend_desc {
    char device[128];      /* e.g. "NVIDIA H100 80GB HBM3"; "" for the CPU */
    uint64_t memory_bytes; /* device memory; 0 for the CPU */
    uint64_t free_bytes;   /* of it free now (what the device reports); 0 for the CPU */
    int healthy;           /* 0 once an error left the device unusable (never cleared) */
} kvd_backend_desc;

/* One copy of a batch (kvd_backend_copy_batch). */
typedef struct kvd_copy {
    void *dst;
    const void *src;
    size_t bytes;
    int to_device; /* 1: host src -> backend dst; 0: backend src -> host dst */
    int within;    /* 1: src and dst both in the backend's memory (to_device ignored) */
} kvd_copy;

typedef struct kvd_backend_iface {
    const char *name; /* "cpu", "cuda" */

    void (*free)(kvd_backend *be);
    int (*alloc)(kvd_backend *be, size_t bytes, void **out, kvd_error *err);
    void (*dealloc)(kvd_backend *be, void *ptr);
    int (*upload)(kvd_backend *be, void *dst, const void *host_src, size_t bytes, kvd_error *err);
    int (*download)(kvd_backend *be, void *host_dst, const void *src, size_t bytes, kvd_error *err);
    int (*sync)(kvd_backend *be, kvd_error *err);

    const struct kvd_convert_ops *convert;
    const struct kvd_quant_ops *quant;
    const struct kvd_kmeans_ops *kmeans;
    const struct kvd_vq_ops *vq;
    const struct kvd_pq_ops *pq;
    const struct kvd_svd_ops *svd;
    const struct kvd_attn_ops *attn;

    /* NULL: no device, always healthy */
    void (*describe)(const kvd_backend *be, kvd_backend_desc *out);
    /* Memory for the ops the calling thread issues next, freed in their
     * order (CUDA: stream-ordered on the thread's stream, no device-wide
     * synchronisation). NULL: alloc / dealloc. */
    int (*scratch)(kvd_backend *be, size_t bytes, void **out, kvd_error *err);
    void (*scratch_free)(kvd_backend *be, void *ptr);
    /* height rows of width bytes, both in backend memory, ordered after the
     * calling thread's earlier ops. NULL: a loop of memcpy (host memory). */
    int (*copy2d)(kvd_backend *be, void *dst, size_t dpitch, const void *src, size_t spitch,
                  size_t width, size_t height, kvd_error *err);
    /* Host memory the device copies to and from directly (CUDA: pinned,
     * page-locked; upload/download from inside it skip the staging copy).
     * NULL: aligned_alloc / free. */
    int (*host_alloc)(kvd_backend *be, size_t bytes, void **out, kvd_error *err);
    void (*host_free)(kvd_backend *be, void *ptr);
    /* n copies between host and backend memory, none overlapping another,
     * queued together on the calling thread's stream and waited for once
     * (CUDA: host sides inside host_alloc memory are DMA'd directly, the
     * others pipelined through the staging buffer, several to a half).
     * NULL: upload / download each. */
    int (*copy_batch)(kvd_backend *be, const kvd_copy *ops, size_t n, kvd_error *err);
} kvd_backend_iface;

struct kvd_backend {
    const kvd_backend_iface *iface;
    void *ctx;    /* backend private state (threads, device, streams) */
    int nthreads; /* worker threads a CPU op may use (>= 1) */
};

typedef struct kvd_cpu_options {
    int nthreads;  /* threads one op may use; 0 = the CPUs the process may run on */
    int force_ref; /* 1 = use the scalar reference for every op (tests) */
    int slots;     /* threads of the process that compute at once, all ops and
                      backends together (at least nthreads; the largest asked
                      holds); 0 = one more than the CPUs the process may run
                      on (kernels/cpu/par.c says why) */
    int background_nice; /* while other tasks compute, a task ranked long
                            (kvd_cpu_task_begin) computes on background
                            threads of lower priority: SCHED_IDLE
                            (KVD_CPU_BACKGROUND_IDLE), or this much nicer
                            than the process (1..19); -1 = never (it
                            computes on its own thread as any task); 0 =
                            as set before (SCHED_IDLE until then); the last
                            set holds */
} kvd_cpu_options;

/* kvd_cpu_options.background_nice: background threads under SCHED_IDLE, the
 * lowest priority (any other thread of the process takes their CPU at once). */
#define KVD_CPU_BACKGROUND_IDLE 20

/* 1 while the background lane is off by itself: its helpers held CPU
 * slots and had not moved for 200 ms while the process computed less than
 * half a CPU (the OS kept them aside for other busy processes in the
 * process's cgroup or session: SCHED_IDLE or a high nice value gave them
 * next to no CPU). Long tasks then compute on their own threads, as with
 * background_nice -1, until the first long task 30 s later tries the lane
 * again; each time it starves again within as long as it was off, it
 * stays off twice as long (at most 32 minutes). 0 otherwise. */
int kvd_cpu_background_starved(void);
/* Times the background lane went off by itself since the start. */
long kvd_cpu_background_starvations(void);

/*
 * The calling thread starts a new task (a request): its computing time,
 * which ranks it for the CPU slots (the task that has computed least goes
 * first, up to 20 ms; longer ones in the order they began, and, while
 * other tasks compute, on background threads of lower OS priority),
 * counts from zero again. A thread that never calls it keeps counting from
 * its first computing, so new tasks go ahead of it.
 */
void kvd_cpu_task_begin(void);

/*
 * The calling thread's task will read about `bytes` bytes of data (an
 * Attend: the f16 K/V of the tokens it attends): it ranks as long as that
 * takes from its start, so that a long request does not go ahead of short
 * ones before it has computed long enough to tell.
 */
void kvd_cpu_task_expect(uint64_t bytes);

/* Create the CPU backend. *out is NULL on failure. Free with kvd_backend_free. */
int kvd_backend_cpu_create(const kvd_cpu_options *opt, kvd_backend **out, kvd_error *err);

/* Create the CUDA backend on device `device` (-1 = first). Returns KVD_EUNSUPP
 * when kvdepot was built without CUDA and KVD_EUNAVAIL when no device is
 * present. *out is NULL on failure. */
int kvd_backend_cuda_create(int device, kvd_backend **out, kvd_error *err);

/* Free a backend; NULL is a no-op. */
void kvd_backend_free(kvd_backend *be);

/*
 * The same backend with its ops limited to `nthreads` CPU threads (clamped to
 * 1..be->nthreads), for callers that already run one op on each thread of
 * their own (the store codes pages on the server's worker threads). The copy
 * shares be's state: it is valid while be lives and is never freed.
 */
kvd_backend kvd_backend_narrow(const kvd_backend *be, int nthreads);

int kvd_backend_alloc(kvd_backend *be, size_t bytes, void **out, kvd_error *err);
void kvd_backend_dealloc(kvd_backend *be, void *ptr);
int kvd_backend_upload(kvd_backend *be, void *dst, const void *host_src, size_t bytes, kvd_error *err);
int kvd_backend_download(kvd_backend *be, void *host_dst, const void *src, size_t bytes,
                         kvd_error *err);
int kvd_backend_sync(kvd_backend *be, kvd_error *err);
/* Scratch memory of the calling thread's next ops (see iface.scratch):
 * cheap to take and give back between calls, valid for ops issued from
 * the same thread until kvd_backend_scratch_free. */
int kvd_backend_scratch(kvd_backend *be, size_t bytes, void **out, kvd_error *err);
void kvd_backend_scratch_free(kvd_backend *be, void *ptr);
/* Copy height rows of width bytes within the backend's memory: row r from
 * src + r * spitch to dst + r * dpitch. */
int kvd_backend_copy2d(kvd_backend *be, void *dst, size_t dpitch, const void *src, size_t spitch,
                       size_t width, size_t height, kvd_error *err);
/* The backend's device, memory and health. */
void kvd_backend_describe(const kvd_backend *be, kvd_backend_desc *out);
/* Host memory for transfers with the backend (see iface.host_alloc),
 * 64-byte aligned; KVD_ENOMEM when none is left (pinned memory is limited
 * by the system's locked-memory limits). */
int kvd_backend_host_alloc(kvd_backend *be, size_t bytes, void **out, kvd_error *err);
void kvd_backend_host_free(kvd_backend *be, void *ptr);
/* The copies of ops (see iface.copy_batch), all done when it returns; on
 * an error some may not have been made. */
int kvd_backend_copy_batch(kvd_backend *be, const kvd_copy *ops, size_t n, kvd_error *err);

/* Runtime CPU features (cached after the first call). */
int kvd_cpu_has_avx2_fma(void);

#endif /* KVDEPOT_BACKEND_H */
