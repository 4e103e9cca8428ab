// memfit's CUDA emulator: runs the kernel sources of `crates/cuda/kernels` on the host, so the cuda
// backend's launchers and kernels are tested on machines without a GPU (our CI). Included in front of
// `common.cuh` when the host C++ compiler builds a source (`memfit-cuda/src/emulator.rs`).
//
// A launch runs its blocks one after another; the threads of a block are fibers (ucontext) on the
// calling OS thread, switched at `__syncthreads()`, so block-shared memory and barriers behave as on
// a GPU. Fibers never preempt each other, which makes every atomic trivially atomic. What it does not
// imitate: warps (the kernels use none of their intrinsics), float rounding of the GPU's math library,
// and races between threads (a kernel that races would pass here and fail there).

#pragma once
#include <cmath>
#include <math.h>
#include <cstdint>
#include <cstring>
#include <utility>
#include <type_traits>
#include <ucontext.h>
#include <sys/mman.h>

#define MEMFIT_EMULATOR 1
#define __global__
#define __device__
#define __forceinline__ inline
// Block-shared memory: one instance per OS thread, reused by the blocks it runs in turn.
#define __shared__ static thread_local

struct dim3 {
    unsigned x, y, z;
};

inline thread_local dim3 threadIdx{0, 0, 0};
inline thread_local dim3 blockIdx{0, 0, 0};
inline thread_local dim3 blockDim{1, 1, 1};
inline thread_local dim3 gridDim{1, 1, 1};

using std::isfinite;
using std::isnan;

inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
inline int __float_as_int(float f) { int i; std::memcpy(&i, &f, 4); return i; }
template <typename T> inline T min(T a, T b) { return b < a ? b : a; }
template <typename T> inline T max(T a, T b) { return a < b ? b : a; }
inline float rsqrt(float x) { return 1.0f / std::sqrt(x); }
inline double rsqrt(double x) { return 1.0 / std::sqrt(x); }

// Atomics: fibers switch only at barriers, so a plain read-modify-write is atomic.
template <typename T> inline T atomicCAS(T* address, T compare, T value) {
    T old = *address;
    if (old == compare) *address = value;
    return old;
}
template <typename T> inline T atomicAdd(T* address, T value) {
    T old = *address;
    *address = old + value;
    return old;
}
template <typename T> inline T atomicMax(T* address, T value) {
    T old = *address;
    if (value > old) *address = value;
    return old;
}

namespace memfit_emu {

constexpr size_t STACK_BYTES = 128 << 10;
constexpr unsigned MAX_THREADS = 1024;

enum State { READY, AT_BARRIER, DONE };

struct Fiber {
    ucontext_t context;
    State state;
};

struct Launch {
    ucontext_t scheduler;
    Fiber* current;
    void (*body)(void**);
    void** params;
};

inline thread_local Launch* running = nullptr;

// Stacks for up to MAX_THREADS fibers, mapped once per OS thread (pages are touched only as used).
inline char* stacks() {
    static thread_local char* base = nullptr;
    if (!base) {
        void* p = mmap(nullptr, STACK_BYTES * MAX_THREADS, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        base = p == MAP_FAILED ? nullptr : static_cast<char*>(p);
    }
    return base;
}

inline void fiber_main() {
    Launch* l = running;
    l->body(l->params);
    l->current->state = DONE;  // returns to uc_link, the scheduler
}

inline void barrier() {
    Launch* l = running;
    l->current->state = AT_BARRIER;
    swapcontext(&l->current->context, &l->scheduler);
}

// Runs `body(params)` as a grid of `grid` blocks of `block` threads. Returns 0, or -1 when the
// launch cannot be emulated (too many threads, no memory for stacks).
inline int launch(unsigned grid, unsigned block, void (*body)(void**), void** params) {
    char* stack = stacks();
    if (block == 0 || block > MAX_THREADS || !stack) return -1;
    static thread_local Fiber* fibers = new Fiber[MAX_THREADS];
    Launch l{};
    l.body = body;
    l.params = params;
    Launch* outer = running;
    running = &l;
    gridDim = {grid, 1, 1};
    blockDim = {block, 1, 1};
    for (unsigned b = 0; b < grid; ++b) {
        blockIdx = {b, 0, 0};
        for (unsigned t = 0; t < block; ++t) {
            Fiber& f = fibers[t];
            getcontext(&f.context);
            f.context.uc_stack.ss_sp = stack + t * STACK_BYTES;
            f.context.uc_stack.ss_size = STACK_BYTES;
            f.context.uc_link = &l.scheduler;
            makecontext(&f.context, fiber_main, 0);
            f.state = READY;
        }
        // Round after round: every live thread runs to its next barrier (or its end).
        bool live = true;
        while (live) {
            live = false;
            for (unsigned t = 0; t < block; ++t) {
                Fiber& f = fibers[t];
                if (f.state == DONE) continue;
                threadIdx = {t, 0, 0};
                l.current = &f;
                f.state = READY;
                swapcontext(&l.scheduler, &f.context);
                if (f.state != DONE) live = true;
            }
        }
    }
    running = outer;
    return 0;
}

// Calls kernel `f` with its arguments read from `params` (each a pointer to the argument's value,
// as cuLaunchKernel takes them).
template <typename... A, size_t... I>
inline void call_with(void (*f)(A...), void** params, std::index_sequence<I...>) {
    f(*static_cast<std::remove_cv_t<std::remove_reference_t<A>>*>(params[I])...);
}

template <typename... A>
inline void call(void (*f)(A...), void** params) {
    call_with(f, params, std::index_sequence_for<A...>{});
}

}  // namespace memfit_emu

inline void __syncthreads() { memfit_emu::barrier(); }

// Generates the entry point memfit's emulator calls for kernel NAME.
#define MEMFIT_EMULATED(NAME)                                                                          \
    extern "C" int memfit_emu_##NAME(unsigned grid, unsigned block, void** params) {                   \
        return memfit_emu::launch(grid, block, [](void** p) { memfit_emu::call(NAME, p); }, params);   \
    }
