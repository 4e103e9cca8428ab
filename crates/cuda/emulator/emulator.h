// memfit's CUDA emulator: runs the kernel sources of `crates/cuda/kernels` on the host, so the cuda
// backend's launchers and kernels are tested on machines without a GPU (our CI). Included in front of
// `common.cuh` when the host C++ compiler builds a source (`memfit-cuda/src/emulator.rs`).
//
// A launch runs its blocks one after another; the threads of a block are fibers (ucontext) on the
// calling OS thread, switched at `__syncthreads()`, so block-shared memory and barriers behave as on
// a GPU. Fibers never preempt each other, which makes every atomic trivially atomic. A warp's
// collectives (`__shfl_xor_sync`, the tensor cores' `mma` through `memfit_emu::mma`) meet at a warp
// barrier: each lane leaves its operands in the block's lane slots, the warp's 32 lanes switch out
// until all have arrived, then each reads what it needs. What it does not imitate: float rounding
// of the GPU's math library, the tensor cores' order of additions, and races between threads (a
// kernel that races would pass here and fail there).

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
#define __align__(n) alignas(n)
#define __launch_bounds__(...)
// Block-shared memory: one instance per OS thread, reused by the blocks it runs in turn.
#define __shared__ static thread_local

struct dim3 {
    unsigned x, y, z;
};
// CUDA's vector type of two floats (8-byte aligned, as loads of it need).
struct alignas(8) float2 {
    float x, y;
};
// And of four floats, and of two unsigned ints (16- and 8-byte aligned), with their makers.
struct alignas(16) float4 {
    float x, y, z, w;
};
struct alignas(8) uint2 {
    unsigned x, y;
};
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }
inline uint2 make_uint2(unsigned x, unsigned y) { return uint2{x, y}; }

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

enum State { READY, AT_BARRIER, AT_WARP, DONE };

constexpr unsigned WARP = 32;

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

// Switches out until the barrier `at` (a block's or a warp's) opens.
inline void wait(State at) {
    Launch* l = running;
    l->current->state = at;
    swapcontext(&l->current->context, &l->scheduler);
}

inline void barrier() { wait(AT_BARRIER); }

// What a lane leaves for the rest of its warp at a collective.
struct LaneSlot {
    uint32_t a[4], b[2];
    uint64_t word;
};
inline thread_local LaneSlot lane_slots[MAX_THREADS];

// Thread t's slot, and the slot of lane `lane` of t's warp.
inline LaneSlot& own_slot() { return lane_slots[threadIdx.x]; }
inline const LaneSlot& lane_slot(unsigned lane) { return lane_slots[(threadIdx.x & ~(WARP - 1)) | lane]; }

// `__shfl_xor_sync` over the whole warp: v from lane (own lane ^ mask).
template <typename T>
inline T shfl_xor(T v, int mask) {
    static_assert(sizeof(T) <= 8, "a shuffle moves at most 8 bytes");
    own_slot().word = 0;
    std::memcpy(&own_slot().word, &v, sizeof(T));
    wait(AT_WARP);
    T r;
    std::memcpy(&r, &lane_slot((threadIdx.x ^ unsigned(mask)) & (WARP - 1)).word, sizeof(T));
    wait(AT_WARP);  // every lane has read before any lane's next collective writes
    return r;
}

// binary16 bits as a float (exactly).
inline float f16_value(uint32_t h) {
    uint32_t sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu, bits;
    if (e == 0x1f) bits = sign | 0x7f800000u | (m << 13);
    else if (e != 0) bits = sign | ((e + 112) << 23) | (m << 13);
    else {
        float v = std::ldexp(float(m), -24);
        std::memcpy(&bits, &v, 4);
        bits |= sign;
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

// Element `half` (0: low 16 bits) of a fragment register, as a float: KIND 1 bfloat16, 2 binary16.
template <int KIND>
inline float element(uint32_t reg, unsigned half) {
    uint32_t h = (reg >> (16 * half)) & 0xffffu;
    if (KIND == 2) return f16_value(h);
    uint32_t bits = h << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

// `mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}` over the warp: d (the lane's four elements of
// the 16 x 8 accumulator) += A (16 x 16) B (16 x 8), each lane holding the PTX ISA's fragments:
// lane = 4 g + t holds A(g + 8 (r & 1), 2 t + 8 (r >> 1) + h) in half h of a[r], B(2 t + 8 r + h, g)
// in half h of b[r], and D(g + 8 (i >> 1), 2 t + (i & 1)) in d[i]. Each sum runs over k in order in
// f32 (the tensor cores' own order is theirs: results agree up to the order of additions).
template <int KIND>
inline void mma(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
    LaneSlot& own = own_slot();
    for (int r = 0; r < 4; ++r) own.a[r] = a[r];
    for (int r = 0; r < 2; ++r) own.b[r] = b[r];
    wait(AT_WARP);
    const unsigned lane = threadIdx.x & (WARP - 1), g = lane / 4, t = lane % 4;
    for (unsigned i = 0; i < 4; ++i) {
        unsigned row = g + 8 * (i >> 1), col = 2 * t + (i & 1);
        float sum = 0.0f;
        for (unsigned k = 0; k < 16; ++k) {
            const LaneSlot& from_a = lane_slot(4 * (row % 8) + (k % 8) / 2);
            const LaneSlot& from_b = lane_slot(4 * col + (k % 8) / 2);
            float x = element<KIND>(from_a.a[(row / 8) + 2 * (k / 8)], k % 2);
            float y = element<KIND>(from_b.b[k / 8], k % 2);
            sum += x * y;
        }
        d[i] += sum;
    }
    wait(AT_WARP);
}

// `ldmatrix.sync.aligned.m8n8.x4{.trans}.shared.b16` over the warp: lane l gives `row`, the address
// of row l % 8 (eight 16-bit elements) of matrix l / 8; lane 4 g + t receives in r[m] matrix m's
// row g, columns 2 t and 2 t + 1 (the lower column in the low half), or with TRANS its column g,
// rows 2 t and 2 t + 1 (the lower row in the low half).
template <bool TRANS>
inline void ldmatrix(uint32_t (&r)[4], const void* row) {
    own_slot().word = reinterpret_cast<uint64_t>(row);
    wait(AT_WARP);
    const unsigned lane = threadIdx.x & (WARP - 1), g = lane / 4, t = lane % 4;
    auto at = [](unsigned matrix, unsigned row, unsigned col) -> uint32_t {
        const uint16_t* p = reinterpret_cast<const uint16_t*>(lane_slot(8 * matrix + row).word);
        return p[col];
    };
    for (unsigned m = 0; m < 4; ++m)
        r[m] = TRANS ? at(m, 2 * t, g) | (at(m, 2 * t + 1, g) << 16) : at(m, g, 2 * t) | (at(m, g, 2 * t + 1) << 16);
    wait(AT_WARP);  // every lane has read before any lane's next collective writes
}

// `cp.async` of `bytes` (4 or 16) from global to shared memory, zeros where `valid` is false: fibers
// switch only at barriers, so the copy is done at once (the waits that follow it have nothing left
// to wait for).
inline void copy_async(void* to, const void* from, unsigned bytes, bool valid) {
    if (valid) std::memcpy(to, from, bytes);
    else std::memset(to, 0, bytes);
}

// Runs one block's fibers to their ends: every ready fiber runs to its next barrier; a warp whose
// live lanes all wait at a warp barrier goes on; when nothing else can, a block barrier that every
// live fiber waits at opens. False when the block deadlocks (fibers waiting at barriers that can
// never open: a barrier in divergent code, which a GPU would hang on too).
inline bool run_block(Launch& l, Fiber* fibers, unsigned block) {
    for (;;) {
        bool moved = false;
        for (unsigned t = 0; t < block; ++t) {
            Fiber& f = fibers[t];
            if (f.state != READY) continue;
            threadIdx = {t, 0, 0};
            l.current = &f;
            swapcontext(&l.scheduler, &f.context);
            moved = true;
        }
        for (unsigned w = 0; w < block; w += WARP) {
            unsigned end = w + WARP < block ? w + WARP : block, waiting = 0, alive = 0;
            for (unsigned t = w; t < end; ++t) {
                alive += fibers[t].state != DONE;
                waiting += fibers[t].state == AT_WARP;
            }
            if (waiting > 0 && waiting == alive) {
                for (unsigned t = w; t < end; ++t)
                    if (fibers[t].state == AT_WARP) fibers[t].state = READY;
                moved = true;
            }
        }
        if (moved) continue;
        unsigned at_barrier = 0, alive = 0;
        for (unsigned t = 0; t < block; ++t) {
            alive += fibers[t].state != DONE;
            at_barrier += fibers[t].state == AT_BARRIER;
        }
        if (alive == 0) return true;
        if (at_barrier != alive) return false;
        for (unsigned t = 0; t < block; ++t)
            if (fibers[t].state == AT_BARRIER) fibers[t].state = READY;
    }
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
        if (!run_block(l, fibers, block)) {
            running = outer;
            return -1;
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
inline void __syncwarp(unsigned = 0xffffffffu) { memfit_emu::wait(memfit_emu::AT_WARP); }
template <typename T> inline T __shfl_xor_sync(unsigned, T v, int mask) { return memfit_emu::shfl_xor(v, mask); }

// Generates the entry point memfit's emulator calls for kernel NAME.
#define MEMFIT_EMULATED(NAME)                                                                          \
    extern "C" int memfit_emu_##NAME(unsigned grid, unsigned block, void** params) {                   \
        return memfit_emu::launch(grid, block, [](void** p) { memfit_emu::call(NAME, p); }, params);   \
    }
