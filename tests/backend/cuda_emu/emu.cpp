/*
 * CPU emulation of CUDA for kernels/cuda (see emu.h): the fiber scheduler
 * that runs a launch, and the runtime and cuBLAS calls of the backend.
 *
 * The emulated device: "CUDA emulation", KVD_EMU_SMS multiprocessors (2 by
 * default), KVD_EMU_DEVICE_MIB MiB of memory (8192 by default; an allocation
 * past it fails with cudaErrorMemoryAllocation, as on a full GPU), 227 KiB
 * of opt-in shared memory per block. Fibers get 256 KiB stacks.
 * A copy whose kind does not match where its ends lie (a host pointer
 * given as device memory, or the reverse) fails with cudaErrorInvalidValue,
 * where a GPU would fault or copy garbage.
 * KVD_EMU_FAULT_AT_LAUNCH=N makes the Nth launch of the process (from 1)
 * fail with cudaErrorIllegalAddress without running, as a kernel that
 * faults does on a GPU: the backend's reaction to a sticky error can be
 * tested.
 *
 * On x86-64 switching between fibers is _setjmp/_longjmp (no signal mask
 * saved, so no system call per switch) and a fiber is entered the first time
 * by pointing the stack pointer at its stack. Elsewhere, and under
 * AddressSanitizer or ThreadSanitizer (which follow swapcontext but not a
 * hand-made switch), every switch is swapcontext.
 */
#include <pthread.h>
#include <setjmp.h>
#include <stdio.h>
#include <stdlib.h>
#include <ucontext.h>

#include <map>
#include <vector>

#include "emu.h"

dim3 threadIdx, blockIdx, blockDim, gridDim;
void *emu_smem;

namespace {

#if defined(__x86_64__) && !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
#define EMU_FAST_SWITCH 1
#endif

struct Fiber {
    ucontext_t ctx; /* without EMU_FAST_SWITCH */
    jmp_buf jb;     /* where the fiber resumes (EMU_FAST_SWITCH) */
    std::vector<char> stack;
    int done, started;
};

const size_t kStack = 256 * 1024;

ucontext_t g_sched;
jmp_buf g_sched_jb;       /* where the scheduler resumes */
std::vector<Fiber> g_fib; /* grows to the largest block seen; stacks kept */
const std::function<void()> *g_body;
int g_cur, g_nthreads;
/* barriers: block-wide (index 0) and per warp (1 + warp) */
std::vector<int> g_count, g_gen;
std::vector<uint64_t> g_slot;
/* one launch at a time, whatever the host thread */
pthread_mutex_t g_launch_mu = PTHREAD_MUTEX_INITIALIZER;

void set_tid(int t)
{
    g_cur = t;
    threadIdx = dim3((unsigned)t, 0, 0);
}

void yield_to_sched(void)
{
    int me = g_cur;
#ifdef EMU_FAST_SWITCH
    if (!_setjmp(g_fib[(size_t)me].jb))
        _longjmp(g_sched_jb, 1);
#else
    swapcontext(&g_fib[(size_t)me].ctx, &g_sched);
#endif
    set_tid(me);
}

void barrier(int b, int size)
{
    int gen = g_gen[(size_t)b];
    if (++g_count[(size_t)b] == size) {
        g_count[(size_t)b] = 0;
        g_gen[(size_t)b]++;
        return;
    }
    while (g_gen[(size_t)b] == gen)
        yield_to_sched();
}

#ifdef EMU_FAST_SWITCH
[[noreturn]] void fiber_main(void)
{
    (*g_body)();
    g_fib[(size_t)g_cur].done = 1;
    _longjmp(g_sched_jb, 1);
}

/* Run fiber t until it yields or ends. */
void resume(int t)
{
    Fiber &f = g_fib[(size_t)t];
    set_tid(t);
    if (_setjmp(g_sched_jb))
        return;
    if (f.started)
        _longjmp(f.jb, 1);
    f.started = 1;
    uintptr_t top = ((uintptr_t)f.stack.data() + kStack) & ~(uintptr_t)15;
    __asm__ volatile("mov %0, %%rsp\n\tcall *%1\n\tud2" : : "r"(top), "r"(fiber_main) : "memory");
    __builtin_unreachable();
}
#else
void fiber_main(void)
{
    (*g_body)();
    g_fib[(size_t)g_cur].done = 1;
    /* returning resumes uc_link (the scheduler) */
}

void resume(int t)
{
    Fiber &f = g_fib[(size_t)t];
    set_tid(t);
    if (!f.started) {
        f.started = 1;
        getcontext(&f.ctx);
        f.ctx.uc_stack.ss_sp = f.stack.data();
        f.ctx.uc_stack.ss_size = kStack;
        f.ctx.uc_link = &g_sched;
        makecontext(&f.ctx, fiber_main, 0);
    }
    swapcontext(&g_sched, &f.ctx);
}
#endif

int warp_size_of(int t)
{
    int w0 = t & ~31, n = g_nthreads - w0;
    return n < 32 ? n : 32;
}

long env_long(const char *name, long def)
{
    const char *v = getenv(name);
    return v && *v ? atol(v) : def;
}

} // namespace

void emu_misaligned(const void *p, size_t align)
{
    fprintf(stderr, "emu: misaligned %zu-byte load at %p (thread %d of block %u)\n", align, p,
            g_cur, blockIdx.x);
    abort();
}

void emu_syncthreads(void) { barrier(0, g_nthreads); }

void emu_syncwarp(void) { barrier(1 + (g_cur >> 5), warp_size_of(g_cur)); }

uint64_t emu_exchange(uint64_t v, int src_lane)
{
    int me = g_cur, w0 = me & ~31;
    g_slot[(size_t)me] = v;
    emu_syncwarp();
    int src = w0 + src_lane;
    uint64_t r = src < g_nthreads ? g_slot[(size_t)src] : v;
    emu_syncwarp(); /* nobody overwrites a slot before every lane read it */
    return r;
}

unsigned emu_ballot(int pred)
{
    int me = g_cur, w0 = me & ~31;
    g_slot[(size_t)me] = pred != 0;
    emu_syncwarp();
    unsigned m = 0;
    for (int i = 0; i < warp_size_of(me); i++)
        if (g_slot[(size_t)(w0 + i)])
            m |= 1u << i;
    emu_syncwarp();
    return m;
}

namespace
{
thread_local cudaError_t t_last = cudaSuccess;
}

void emu_run(dim3 grid, dim3 block, size_t smem, const std::function<void()> &body)
{
    int nt = (int)(block.x * block.y * block.z);
    /* what a GPU refuses to launch */
    if (nt < 1 || nt > 1024 || block.y != 1 || block.z != 1 || smem > 227 * 1024 || grid.x < 1 ||
        grid.y < 1 || grid.z < 1 || grid.y > 65535 || grid.z > 65535) {
        t_last = cudaErrorInvalidValue;
        return;
    }
    pthread_mutex_lock(&g_launch_mu);
    static long launches;
    static const long fault_at = env_long("KVD_EMU_FAULT_AT_LAUNCH", 0);
    if (++launches == fault_at) {
        pthread_mutex_unlock(&g_launch_mu);
        t_last = cudaErrorIllegalAddress;
        return;
    }
    std::vector<unsigned char> sm(smem + 16);
    g_nthreads = nt;
    g_body = &body;
    gridDim = grid;
    blockDim = block;
    if (g_fib.size() < (size_t)nt) {
        g_fib.resize((size_t)nt);
        for (Fiber &f : g_fib)
            f.stack.resize(kStack);
    }
    g_count.assign((size_t)(2 + nt / 32), 0);
    g_gen.assign((size_t)(2 + nt / 32), 0);
    g_slot.assign((size_t)nt, 0);
    /* KVD_EMU_REVERSE=1 runs the threads of a phase in the other order: a
     * missing barrier shows as a stale read one way or the other */
    static const int rev = getenv("KVD_EMU_REVERSE") && atoi(getenv("KVD_EMU_REVERSE"));
    for (unsigned bz = 0; bz < grid.z; bz++)
        for (unsigned by = 0; by < grid.y; by++)
            for (unsigned bx = 0; bx < grid.x; bx++) {
                blockIdx = dim3(bx, by, bz);
                memset(sm.data(), 0xff, sm.size()); /* NaN floats: reads before writes show */
                emu_smem = sm.data();
                for (int t = 0; t < nt; t++)
                    g_fib[(size_t)t].done = g_fib[(size_t)t].started = 0;
                for (int left = nt; left > 0;) {
                    left = 0;
                    for (int i = 0; i < nt; i++) {
                        int t = rev ? nt - 1 - i : i;
                        if (g_fib[(size_t)t].done)
                            continue;
                        resume(t);
                        if (!g_fib[(size_t)t].done)
                            left++;
                    }
                }
                for (size_t b = 0; b < g_count.size(); b++)
                    if (g_count[b]) {
                        fprintf(stderr,
                                "emu: block (%u,%u,%u) ended with threads waiting at barrier "
                                "%zu\n",
                                bx, by, bz, b);
                        abort();
                    }
            }
    pthread_mutex_unlock(&g_launch_mu);
}

/* ---- runtime ------------------------------------------------------------------ */

struct emu_stream {
    int unused;
};
struct emu_event {
    int unused;
};
struct emu_pool {
    int unused;
};
struct emu_blas {
    cudaStream_t s;
};

namespace
{

pthread_mutex_t g_mem_mu = PTHREAD_MUTEX_INITIALIZER;
std::map<void *, size_t> g_alloc; /* device allocations and their sizes */
size_t g_used;
emu_pool g_pool;

size_t device_bytes(void)
{
    return (size_t)env_long("KVD_EMU_DEVICE_MIB", 8192) << 20;
}

cudaError_t fail(cudaError_t e)
{
    t_last = e;
    return e;
}

} // namespace

const char *cudaGetErrorString(cudaError_t e)
{
    switch (e) {
    case cudaSuccess:
        return "no error";
    case cudaErrorInvalidValue:
        return "invalid argument";
    case cudaErrorMemoryAllocation:
        return "out of memory";
    case cudaErrorNoDevice:
        return "no CUDA-capable device is detected";
    case cudaErrorInvalidDevice:
        return "invalid device ordinal";
    default:
        return "emulated CUDA error";
    }
}

cudaError_t cudaGetLastError(void)
{
    cudaError_t e = t_last;
    t_last = cudaSuccess;
    return e;
}

cudaError_t cudaGetDeviceCount(int *n)
{
    *n = 1;
    return cudaSuccess;
}

cudaError_t cudaSetDevice(int device)
{
    return device == 0 ? cudaSuccess : fail(cudaErrorInvalidDevice);
}

cudaError_t cudaGetDeviceProperties(cudaDeviceProp *p, int device)
{
    if (device != 0)
        return fail(cudaErrorInvalidDevice);
    memset(p, 0, sizeof *p);
    snprintf(p->name, sizeof p->name, "CUDA emulation");
    p->totalGlobalMem = device_bytes();
    p->multiProcessorCount = (int)env_long("KVD_EMU_SMS", 2);
    p->sharedMemPerBlockOptin = 227 * 1024;
    p->major = 9;
    return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int *v, cudaDeviceAttr attr, int device)
{
    if (device != 0)
        return fail(cudaErrorInvalidDevice);
    /* a 2 TB/s memory: 2 * clock (kHz) * bus width / 8 */
    *v = attr == cudaDevAttrMemoryClockRate ? 1000000 : 8192;
    return cudaSuccess;
}

cudaError_t cudaDeviceGetDefaultMemPool(cudaMemPool_t *pool, int)
{
    *pool = &g_pool;
    return cudaSuccess;
}

cudaError_t cudaMemPoolSetAttribute(cudaMemPool_t, cudaMemPoolAttr, void *)
{
    return cudaSuccess;
}

cudaError_t cudaMalloc(void **p, size_t n)
{
    *p = NULL;
    pthread_mutex_lock(&g_mem_mu);
    cudaError_t e = cudaSuccess;
    if (n > device_bytes() - g_used) {
        e = cudaErrorMemoryAllocation;
    } else if ((*p = aligned_alloc(256, (n + 255) / 256 * 256)) == NULL) {
        e = cudaErrorMemoryAllocation;
    } else {
        g_alloc[*p] = n;
        g_used += n;
    }
    pthread_mutex_unlock(&g_mem_mu);
    return e ? fail(e) : cudaSuccess;
}

cudaError_t cudaFree(void *p)
{
    if (!p)
        return cudaSuccess;
    pthread_mutex_lock(&g_mem_mu);
    auto it = g_alloc.find(p);
    cudaError_t e = cudaSuccess;
    if (it == g_alloc.end()) {
        e = cudaErrorInvalidValue;
    } else {
        g_used -= it->second;
        g_alloc.erase(it);
        free(p);
    }
    pthread_mutex_unlock(&g_mem_mu);
    return e ? fail(e) : cudaSuccess;
}

cudaError_t cudaMallocAsync(void **p, size_t n, cudaStream_t)
{
    return cudaMalloc(p, n);
}

cudaError_t cudaFreeAsync(void *p, cudaStream_t)
{
    return cudaFree(p);
}

cudaError_t cudaHostAlloc(void **p, size_t n, unsigned)
{
    *p = aligned_alloc(256, (n + 255) / 256 * 256);
    return *p ? cudaSuccess : fail(cudaErrorMemoryAllocation);
}

cudaError_t cudaMemGetInfo(size_t *free_bytes, size_t *total_bytes)
{
    pthread_mutex_lock(&g_mem_mu);
    *total_bytes = device_bytes();
    *free_bytes = g_used < *total_bytes ? *total_bytes - g_used : 0;
    pthread_mutex_unlock(&g_mem_mu);
    return cudaSuccess;
}

cudaError_t cudaFreeHost(void *p)
{
    free(p);
    return cudaSuccess;
}

namespace
{

/* Does [p, p + n) lie inside one device allocation? */
bool in_device(const void *p, size_t n)
{
    const char *c = static_cast<const char *>(p);
    pthread_mutex_lock(&g_mem_mu);
    auto it = g_alloc.upper_bound(const_cast<void *>(p));
    bool in = false;
    if (it != g_alloc.begin()) {
        --it;
        const char *b = static_cast<const char *>(it->first);
        in = c >= b && c + n <= b + it->second;
    }
    pthread_mutex_unlock(&g_mem_mu);
    return in;
}

/* Does a copy's kind say where its ends lie? A GPU faults or copies
 * garbage on a host pointer given as device memory (or the reverse). */
bool kind_fits(void *d, size_t dn, const void *s, size_t sn, cudaMemcpyKind k)
{
    switch (k) {
    case cudaMemcpyHostToDevice:
        return in_device(d, dn) && !in_device(s, 1);
    case cudaMemcpyDeviceToHost:
        return in_device(s, sn) && !in_device(d, 1);
    case cudaMemcpyDeviceToDevice:
        return in_device(d, dn) && in_device(s, sn);
    case cudaMemcpyHostToHost:
        return !in_device(d, 1) && !in_device(s, 1);
    default:
        return true;
    }
}

} /* namespace */

cudaError_t cudaMemcpy(void *d, const void *s, size_t n, cudaMemcpyKind k)
{
    if (n && (!d || !s))
        return fail(cudaErrorInvalidValue);
    if (n && !kind_fits(d, n, s, n, k)) {
        fprintf(stderr,
                "cuda emulation: a %zu-byte copy whose kind (%d) does not say where its "
                "ends lie\n",
                n, (int)k);
        return fail(cudaErrorInvalidValue);
    }
    memmove(d, s, n);
    return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void *d, const void *s, size_t n, cudaMemcpyKind k, cudaStream_t)
{
    return cudaMemcpy(d, s, n, k);
}

cudaError_t cudaMemcpy2DAsync(void *d, size_t dpitch, const void *s, size_t spitch, size_t width,
                              size_t height, cudaMemcpyKind k, cudaStream_t)
{
    if (width > dpitch || width > spitch)
        return fail(cudaErrorInvalidValue);
    if (height && width &&
        !kind_fits(d, (height - 1) * dpitch + width, s, (height - 1) * spitch + width, k))
        return fail(cudaErrorInvalidValue);
    for (size_t r = 0; r < height; r++)
        memmove(static_cast<char *>(d) + r * dpitch, static_cast<const char *>(s) + r * spitch,
                width);
    return cudaSuccess;
}

cudaError_t cudaMemsetAsync(void *d, int v, size_t n, cudaStream_t)
{
    memset(d, v, n);
    return cudaSuccess;
}

cudaError_t cudaStreamCreate(cudaStream_t *s)
{
    *s = new emu_stream();
    return cudaSuccess;
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned)
{
    return cudaStreamCreate(s);
}

cudaError_t cudaStreamDestroy(cudaStream_t s)
{
    delete s;
    return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t)
{
    return cudaSuccess;
}

cudaError_t cudaEventCreate(cudaEvent_t *e)
{
    *e = new emu_event();
    return cudaSuccess;
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned)
{
    return cudaEventCreate(e);
}

cudaError_t cudaEventDestroy(cudaEvent_t e)
{
    delete e;
    return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t, cudaStream_t)
{
    return cudaSuccess;
}

cudaError_t cudaEventSynchronize(cudaEvent_t)
{
    return cudaSuccess;
}

/* ---- cuBLAS ------------------------------------------------------------------- */

cublasStatus_t cublasCreate(cublasHandle_t *h)
{
    *h = new emu_blas();
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasDestroy(cublasHandle_t h)
{
    delete h;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetStream(cublasHandle_t h, cudaStream_t s)
{
    h->s = s;
    return CUBLAS_STATUS_SUCCESS;
}

const char *cublasGetStatusString(cublasStatus_t s)
{
    return s == CUBLAS_STATUS_SUCCESS ? "CUBLAS_STATUS_SUCCESS" : "CUBLAS_STATUS_EMULATED_FAILURE";
}

/* C (m x n) = alpha op(A) op(B) + beta C, column-major: op(A) m x k, op(B)
 * k x n. Accumulated in double, rounded once: within cuBLAS's own error. */
cublasStatus_t cublasSgemm(cublasHandle_t, cublasOperation_t ta, cublasOperation_t tb, int m, int n,
                           int k, const float *alpha, const float *A, int lda, const float *B,
                           int ldb, const float *beta, float *C, int ldc)
{
    if (m < 0 || n < 0 || k < 0)
        return CUBLAS_STATUS_INVALID_VALUE;
    for (int j = 0; j < n; j++)
        for (int i = 0; i < m; i++) {
            double acc = 0;
            for (int p = 0; p < k; p++) {
                float a = ta == CUBLAS_OP_N ? A[i + (size_t)p * lda] : A[p + (size_t)i * lda];
                float b = tb == CUBLAS_OP_N ? B[p + (size_t)j * ldb] : B[j + (size_t)p * ldb];
                acc += (double)a * b;
            }
            float *c = &C[i + (size_t)j * ldc];
            *c = (float)(*alpha * acc + (*beta != 0.0f ? (double)*beta * *c : 0.0));
        }
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSgemmStridedBatched(cublasHandle_t h, cublasOperation_t ta,
                                         cublasOperation_t tb, int m, int n, int k,
                                         const float *alpha, const float *A, int lda, long long sA,
                                         const float *B, int ldb, long long sB, const float *beta,
                                         float *C, int ldc, long long sC, int batch)
{
    for (int i = 0; i < batch; i++) {
        cublasStatus_t s = cublasSgemm(h, ta, tb, m, n, k, alpha, A + i * sA, lda, B + i * sB, ldb,
                                       beta, C + i * sC, ldc);
        if (s != CUBLAS_STATUS_SUCCESS)
            return s;
    }
    return CUBLAS_STATUS_SUCCESS;
}
