/*
 * CPU emulation runtime for kernels/cuda/attn.cu (see emu.h) and an
 * emulated "CUDA" backend whose attention table is attn.cu's: host memory,
 * synchronous launches, 2 "SMs" so that sequences of a few thousand tokens
 * are already split over the token axis and merged by the combine kernel.
 * Its name is not "cpu", so the checked wrappers treat its memory as device
 * memory (the sparse index list is validated by the kernel, as on a GPU).
 */
#include <stdio.h>
#include <stdlib.h>
#include <ucontext.h>

#include <vector>

#include "emu.h"

extern "C" {
#include "kvdepot/attention.h"
#include "kvdepot/backend.h"
}

dim3 threadIdx, blockIdx, blockDim, gridDim;
void *emu_smem;

namespace {

struct Fiber {
    ucontext_t ctx;
    std::vector<char> stack;
    int done;
};

ucontext_t g_sched;
std::vector<Fiber> g_fib;
const std::function<void()> *g_body;
int g_cur, g_nthreads;
/* barriers: block-wide (index 0) and per warp (1 + warp) */
std::vector<int> g_count, g_gen;
std::vector<uint32_t> g_slot;

void set_tid(int t)
{
    g_cur = t;
    threadIdx = dim3((unsigned)t, 0, 0);
}

void yield_to_sched(void)
{
    int me = g_cur;
    swapcontext(&g_fib[me].ctx, &g_sched);
    set_tid(me);
}

void barrier(int b, int size)
{
    int gen = g_gen[b];
    if (++g_count[b] == size) {
        g_count[b] = 0;
        g_gen[b]++;
        return;
    }
    while (g_gen[b] == gen)
        yield_to_sched();
}

void fiber_main(void)
{
    (*g_body)();
    g_fib[g_cur].done = 1;
    /* returning resumes uc_link (the scheduler) */
}

int warp_size_of(int t)
{
    int w0 = t & ~31, n = g_nthreads - w0;
    return n < 32 ? n : 32;
}

} // namespace

void emu_misaligned(const void *p, size_t align)
{
    fprintf(stderr, "emu: misaligned %zu-byte load at %p (thread %d of block %u)\n", align, p, g_cur, blockIdx.x);
    abort();
}

void emu_syncthreads(void) { barrier(0, g_nthreads); }

void emu_syncwarp(void) { barrier(1 + (g_cur >> 5), warp_size_of(g_cur)); }

uint32_t emu_exchange(uint32_t v, int src_lane)
{
    int me = g_cur, w0 = me & ~31;
    g_slot[me] = v;
    emu_syncwarp();
    uint32_t r = g_slot[w0 + src_lane];
    emu_syncwarp(); /* nobody overwrites a slot before every lane read it */
    return r;
}

void emu_run(dim3 grid, dim3 block, size_t smem, const std::function<void()> &body)
{
    std::vector<unsigned char> sm(smem + 16);
    int nt = (int)(block.x * block.y * block.z);
    g_nthreads = nt;
    g_body = &body;
    gridDim = grid;
    blockDim = block;
    g_fib.assign((size_t)nt, Fiber());
    g_count.assign((size_t)(2 + nt / 32), 0);
    g_gen.assign((size_t)(2 + nt / 32), 0);
    g_slot.assign((size_t)nt, 0);
    for (unsigned by = 0; by < grid.y; by++)
        for (unsigned bx = 0; bx < grid.x; bx++) {
            blockIdx = dim3(bx, by, 0);
            memset(sm.data(), 0xff, sm.size()); /* NaN floats: reads before writes show */
            emu_smem = sm.data();
            for (int t = 0; t < nt; t++) {
                Fiber &f = g_fib[(size_t)t];
                f.stack.resize(256 * 1024);
                f.done = 0;
                getcontext(&f.ctx);
                f.ctx.uc_stack.ss_sp = f.stack.data();
                f.ctx.uc_stack.ss_size = f.stack.size();
                f.ctx.uc_link = &g_sched;
                makecontext(&f.ctx, fiber_main, 0);
            }
            /* KVD_EMU_REVERSE=1 runs the threads of a phase in the other
             * order: a missing barrier shows as a stale read one way or
             * the other */
            static const int rev = getenv("KVD_EMU_REVERSE") && atoi(getenv("KVD_EMU_REVERSE"));
            for (int left = nt; left > 0;) {
                left = 0;
                for (int i = 0; i < nt; i++) {
                    int t = rev ? nt - 1 - i : i;
                    if (g_fib[(size_t)t].done)
                        continue;
                    set_tid(t);
                    swapcontext(&g_sched, &g_fib[(size_t)t].ctx);
                    if (!g_fib[(size_t)t].done)
                        left++;
                }
            }
            for (size_t b = 0; b < g_count.size(); b++)
                if (g_count[b]) {
                    fprintf(stderr, "emu: block (%u,%u) ended with threads waiting at barrier %zu\n", bx, by, b);
                    abort();
                }
        }
}

/* ---- the backend internals attn.cu calls ------------------------------------ */

#include "cuda_internal.h"

int kvd__cuda_status(kvd_cuda_ctx *, cudaError_t e, const char *what, kvd_error *err)
{
    if (e == cudaSuccess)
        return KVD_OK;
    return kvd_error_set(err, KVD_EINTERNAL, "emu: %s failed", what);
}

int kvd__cuda_begin(kvd_backend *be, kvd_cuda_call *call, kvd_error *)
{
    call->c = static_cast<kvd_cuda_ctx *>(be->ctx);
    call->slot = NULL;
    call->s = NULL;
    return 0;
}

int kvd__cuda_launched(kvd_cuda_call *, const char *, kvd_error *) { return 0; }

int kvd__cuda_scratch(kvd_cuda_call *, size_t bytes, void **p, kvd_error *err)
{
    *p = malloc(bytes ? bytes : 1);
    if (!*p)
        return kvd_error_set(err, KVD_ENOMEM, "emu: scratch");
    memset(*p, 0xff, bytes); /* NaN: unwritten partials show */
    return 0;
}

void kvd__cuda_scratch_free(kvd_cuda_call *, void *p) { free(p); }

int kvd__cuda_wait(kvd_cuda_call *, const char *, kvd_error *) { return 0; }

/* The kernels as the GPU build has them (generated from attn.cu). */
#include "attn_emu.cpp"

namespace {

kvd_cuda_ctx g_ctx;

void emu_free(kvd_backend *be) { free(be); }
int emu_alloc(kvd_backend *, size_t bytes, void **out, kvd_error *err)
{
    *out = aligned_alloc(256, (bytes + 255) / 256 * 256);
    return *out ? 0 : kvd_error_set(err, KVD_ENOMEM, "emu: alloc");
}
void emu_dealloc(kvd_backend *, void *p) { free(p); }
int emu_copy(kvd_backend *, void *d, const void *s, size_t n, kvd_error *)
{
    memcpy(d, s, n);
    return 0;
}
int emu_sync(kvd_backend *, kvd_error *) { return 0; }

const kvd_backend_iface emu_iface = {
    "cuda-emu", emu_free, emu_alloc, emu_dealloc, emu_copy, emu_copy, emu_sync,
    NULL,       NULL,     NULL,      NULL,        NULL,     NULL,     &kvd__cuda_attn_ops,
};

} // namespace

extern "C" kvd_backend *kvd_attn_emu_backend(void)
{
    g_ctx.device = 0;
    g_ctx.sm_count = 2;
    g_ctx.smem_optin = 227 * 1024;
    kvd_backend *be = static_cast<kvd_backend *>(calloc(1, sizeof *be));
    be->iface = &emu_iface;
    be->ctx = &g_ctx;
    be->nthreads = 1;
    return be;
}
