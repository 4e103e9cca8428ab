// Shared by every memfit kernel source (prepended by memfit-cuda before NVRTC compiles a source).
// Element-wise kernels are grid-stride loops over 64-bit indices; reductions are deterministic
// (fixed tree order within a block, no atomics on floats), so a run repeats bit for bit.

// NVRTC has no <math.h> macros: float infinity and NaN (converted exactly to double where needed).
// (The emulator's host compiler has them.)
#ifndef MEMFIT_EMULATOR
#define INFINITY __int_as_float(0x7f800000)
#define NAN __int_as_float(0x7fffffff)
#endif

typedef long long i64;
typedef unsigned long long u64;

// A strided view of up to 8 dims, row-major walk: element k of the walk is at offset(k).
struct Strided {
    int rank;
    i64 shape[8];
    i64 stride[8];
    i64 offset;
};

// (k is below the view's element count, as every caller's is: one dim needs no division, the view
// the host gives two dense operands of one shape, `coalesced` in memfit-tensor's cuda backend.)
__device__ __forceinline__ i64 strided_offset(const Strided& s, i64 k) {
    if (s.rank == 1) return s.offset + k * s.stride[0];
    i64 off = s.offset;
    for (int d = s.rank - 1; d >= 0; --d) {
        i64 n = s.shape[d];
        off += (k % n) * s.stride[d];
        k /= n;
    }
    return off;
}

// Casts between f32 and bfloat16 bits, rounding to nearest even as PyTorch's `.to()` (a NaN stays
// a quiet NaN).
__device__ __forceinline__ unsigned short f32_to_bf16(float x) {
    unsigned int u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);
    return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
__device__ __forceinline__ float bf16_to_f32(unsigned short h) { return __uint_as_float((unsigned int)h << 16); }

// Casts between f32 and binary16 bits, rounding to nearest even as PyTorch's `.to()` (NaN stays
// NaN).
#ifdef MEMFIT_EMULATOR
__device__ __forceinline__ unsigned short f32_to_f16(float x) {
    _Float16 h = (_Float16)x;
    unsigned short u;
    memcpy(&u, &h, 2);
    return u;
}
__device__ __forceinline__ float f16_to_f32(unsigned short u) {
    _Float16 h;
    memcpy(&h, &u, 2);
    return (float)h;
}
#else
__device__ __forceinline__ unsigned short f32_to_f16(float x) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
}
__device__ __forceinline__ float f16_to_f32(unsigned short h) {
    float x;
    asm("cvt.f32.f16 %0, %1;" : "=f"(x) : "h"(h));
    return x;
}
#endif

// An f32 saved in 16 bits (KIND 1: bfloat16, 2: binary16) as restoring it gives it (the casts
// above, exact: both widen without rounding); widened4, four of them from p (8 bytes, 8-byte
// aligned).
template <int KIND>
__device__ __forceinline__ float widened(unsigned short h) {
    return KIND == 1 ? bf16_to_f32(h) : f16_to_f32(h);
}
template <int KIND>
__device__ __forceinline__ float4 widened4(const unsigned short* p) {
    const uint2 u = *(const uint2*)p;
    return make_float4(widened<KIND>((unsigned short)(u.x & 0xffffu)), widened<KIND>((unsigned short)(u.x >> 16)),
                       widened<KIND>((unsigned short)(u.y & 0xffffu)), widened<KIND>((unsigned short)(u.y >> 16)));
}

// An f32 operand of an element-wise kernel: values in place (`const T*`), or f32 values saved in
// 16 bits (`Saved16<KIND>`: KIND 1 bfloat16, 2 binary16), each read as the f32 that restoring it
// gives (widened), so a kernel computes from them the bits it computes from the restored copy,
// without the copy (GELU-linear's and layer-norm-linear's backward on a GPU read their saved
// inputs so). `fits4`: it may be read four elements a load (16 bytes of f32, 8 of 16-bit ones);
// `at4`, `at1`: its group q, its element k; `offset`: from element n on.
template <int KIND>
struct Saved16 {
    const unsigned short* p;
};
__device__ __forceinline__ bool fits4(const float* a) { return ((u64)a & 15) == 0; }
template <int KIND>
__device__ __forceinline__ bool fits4(Saved16<KIND> a) {
    return ((u64)a.p & 7) == 0;
}
__device__ __forceinline__ float4 at4(const float* a, i64 q) { return ((const float4*)a)[q]; }
template <int KIND>
__device__ __forceinline__ float4 at4(Saved16<KIND> a, i64 q) {
    return widened4<KIND>(a.p + 4 * q);
}
template <typename T>
__device__ __forceinline__ T at1(const T* a, i64 k) {
    return a[k];
}
template <int KIND>
__device__ __forceinline__ float at1(Saved16<KIND> a, i64 k) {
    return widened<KIND>(a.p[k]);
}
template <typename T>
__device__ __forceinline__ const T* offset(const T* a, i64 n) {
    return a + n;
}
template <int KIND>
__device__ __forceinline__ Saved16<KIND> offset(Saved16<KIND> a, i64 n) {
    return Saved16<KIND>{a.p + n};
}

// An operand element as a bf16 product reads it (Note [bf16 products] in memfit-kernels): rounded
// to bfloat16, to nearest even, and a denormal result read as a zero of its sign.
__device__ __forceinline__ float bf16_operand(float x) {
    unsigned int r = (unsigned int)f32_to_bf16(x) << 16;
    return __uint_as_float((r & 0x7f800000u) == 0 ? r & 0x80000000u : r);
}

// An operand element as an fp16 product reads it (Note [fp16 products] in memfit-kernels): rounded
// to binary16, to nearest even, overflowing to infinity from 65,520, subnormals kept; a NaN stays
// a quiet NaN with the payload binary16 keeps (as the cpu's round_f16, F16C's bits).
__device__ __forceinline__ float f16_operand(float x) {
    unsigned int u = __float_as_uint(x), sign = u & 0x80000000u, m = u & 0x7fffffffu;
    if (m > 0x7f800000u) return __uint_as_float((u | 0x00400000u) & 0xffffe000u);
    float a = __uint_as_float(m), r;
    if (a >= 65520.0f) r = INFINITY;
    else if (a < 1.0f / 16384.0f) r = rintf(a * 16777216.0f) / 16777216.0f;
    else r = __uint_as_float((m + 0x0fffu + ((m >> 13) & 1u)) & ~0x1fffu);
    return __uint_as_float(__float_as_uint(r) | sign);
}

// An operand element's bits as the tensor cores read them: KIND 1, bf16_operand's bfloat16; KIND 2,
// f16_operand's binary16 (its value is one exactly, so the bits follow from the float's).
__device__ __forceinline__ unsigned f16_operand_bits(float x) {
    unsigned u = __float_as_uint(f16_operand(x)), sign = (u >> 16) & 0x8000u, m = u & 0x7fffffffu;
    if (m >= 0x7f800000u) return sign | 0x7c00u | ((m >> 13) & 0x3ffu);  // infinity; NaN keeps its payload
    if (m >= 0x38800000u) return sign | (((m >> 23) - 112u) << 10) | ((m >> 13) & 0x3ffu);  // from 2^-14
    return sign | (unsigned)(__uint_as_float(m) * 16777216.0f);  // a subnormal: a multiple of 2^-24
}
template <int KIND>
__device__ __forceinline__ unsigned operand_bits(float x) {
    return KIND == 1 ? __float_as_uint(bf16_operand(x)) >> 16 : f16_operand_bits(x);
}
// Two operand elements in one fragment register (lo in the low half, as the tensor cores pair them).
template <int KIND>
__device__ __forceinline__ unsigned operand_pair(float lo, float hi) {
    return operand_bits<KIND>(lo) | (operand_bits<KIND>(hi) << 16);
}

// operand_pair's bits for two values that only a product reads (rounded operands, attention's P
// and dS): one conversion instruction for the pair, and for bf16 a denormal result made a zero of its sign, as operand_bits does. (A NaN's
// payload may differ from operand_bits', which no product can tell.)
template <int KIND>
__device__ __forceinline__ unsigned operand_pair_fast(float lo, float hi) {
#ifdef MEMFIT_EMULATOR
    return operand_pair<KIND>(lo, hi);
#else
    unsigned r;
    if (KIND == 1) {
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
        const unsigned keep = ((r & 0x7f80u) ? 0x0000ffffu : 0x00008000u) | ((r & 0x7f800000u) ? 0xffff0000u : 0x80000000u);
        return r & keep;
    }
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
#endif
}

// d += A B on the tensor cores: `mma.sync.aligned.m16n8k16.row.col` with f32 accumulation, bf16
// (KIND 1) or fp16 (KIND 2) operands, each lane holding the PTX ISA's fragments (lane 4 g + t: a[r]
// holds A(g + 8 (r & 1), 2 t + 8 (r >> 1) + {0, 1}), b[r] holds B(2 t + 8 r + {0, 1}, g), d[i] is
// D(g + 8 (i >> 1), 2 t + (i & 1))). The emulator runs a model of it (emulator.h).
template <int KIND>
__device__ __forceinline__ void mma_16816(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
#ifdef MEMFIT_EMULATOR
    memfit_emu::mma<KIND>(d, a, b);
#else
    if (KIND == 1)
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    else
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

// Four 8 x 8 matrices of 16-bit elements from shared memory into fragment registers
// (`ldmatrix.sync.aligned.m8n8.x4`): lane l gives `row`, the 16-byte-aligned address of row l % 8 of
// matrix l / 8; lane 4 g + t receives in r[m] matrix m's row g, columns 2 t and 2 t + 1 (the lower
// column in the low half: mma_16816's B fragment of a tile stored B(k, n) = tile[n][k]), or with
// TRANS (`.trans`) its column g, rows 2 t and 2 t + 1 (the B fragment of a tile stored
// B(k, n) = tile[k][n]). The emulator runs a model of it (emulator.h).
template <bool TRANS>
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const void* row) {
#ifdef MEMFIT_EMULATOR
    memfit_emu::ldmatrix<TRANS>(r, row);
#else
    const unsigned at = (unsigned)__cvta_generic_to_shared(row);
    if (TRANS)
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(at));
    else
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(at));
#endif
}

// Copies BYTES (4 or 16, both addresses aligned to it) from global to shared memory without the
// thread waiting (`cp.async`), zeros where `valid` is false (`from` is then not read); a thread's
// copies since its last commit form a group (cp_async_commit), and cp_async_wait<N> waits until at
// most N of its groups are still in flight. Other threads see the bytes after a barrier that
// follows the wait.
template <int BYTES>
__device__ __forceinline__ void cp_async(void* to, const void* from, bool valid) {
#ifdef MEMFIT_EMULATOR
    memfit_emu::copy_async(to, from, BYTES, valid);
#else
    const unsigned at = (unsigned)__cvta_generic_to_shared(to);
    if (BYTES == 16)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(at), "l"(from), "r"(valid ? 16 : 0) : "memory");
    else
        asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(at), "l"(from), "r"(valid ? 4 : 0) : "memory");
#endif
}
__device__ __forceinline__ void cp_async_commit() {
#ifndef MEMFIT_EMULATOR
    asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#ifndef MEMFIT_EMULATOR
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
#endif
}

#define GRID_STRIDE(i, n) for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (i64)gridDim.x * blockDim.x)

// Sum of `v` over the block (blockDim.x a power of two, at most 1024) into every thread's return,
// in a fixed order.
template <typename T>
__device__ T block_sum(T v, T* shared) {
    shared[threadIdx.x] = v;
    __syncthreads();
    for (unsigned s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) shared[threadIdx.x] += shared[threadIdx.x + s];
        __syncthreads();
    }
    T r = shared[0];
    __syncthreads();
    return r;
}

template <typename T>
__device__ T block_max(T v, T* shared) {
    shared[threadIdx.x] = v;
    __syncthreads();
    for (unsigned s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) shared[threadIdx.x] = fmax(shared[threadIdx.x], shared[threadIdx.x + s]);
        __syncthreads();
    }
    T r = shared[0];
    __syncthreads();
    return r;
}

// Column sums of a [rows, cols] matrix in two passes, for a GPU of many multiprocessors (the
// one-pass kernels, a block per 32 columns, gave a layer of 768 columns 24 blocks, a fifth of an
// H100's multiprocessors: GPT-2's bias and layer-norm gradients took 75 us a block of 4,096 rows).
// Pass 1 (here): block (t, s) of COLUMN_WARPS warps sums columns 32 t .. 32 t + 31 over rows
// s * per .. (s + 1) * per, warp w every COLUMN_WARPS-th row from w, the warps' partials added in
// warp order, into part_a[s * cols + j] (and part_b, for a second term; either may be null);
// term(r, j) gives the two terms of element (r, j). Pass 2 is reduce.cu's column_finish: the
// partials of a column added in split order. Fixed orders: a run repeats bit for bit.
#define COLUMN_WARPS 8
template <typename T>
struct Two {
    T a, b;
};
template <typename T, typename Term>
__device__ void column_partials(Term term, i64 rows, i64 cols, i64 per, T* part_a, T* part_b) {
    __shared__ T red[2][COLUMN_WARPS][33];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const i64 tiles = (cols + 31) / 32, t = blockIdx.x % tiles, s = blockIdx.x / tiles, j = 32 * t + lane;
    const i64 r0 = s * per, r1 = min(rows, r0 + per);
    T a = T(0), b = T(0);
    if (j < cols)
        for (i64 r = r0 + warp; r < r1; r += COLUMN_WARPS) {
            const Two<T> v = term(r, j);
            a += v.a;
            b += v.b;
        }
    red[0][warp][lane] = a;
    red[1][warp][lane] = b;
    __syncthreads();
    if (warp == 0 && j < cols) {
        T sa = T(0), sb = T(0);
        for (int w = 0; w < COLUMN_WARPS; ++w) {
            sa += red[0][w][lane];
            sb += red[1][w][lane];
        }
        if (part_a) part_a[s * cols + j] = sa;
        if (part_b) part_b[s * cols + j] = sb;
    }
}

// Groups q < groups from `first`, `step` apart, each thread's two groups' loads (`load(q)`) issued
// before either is used (`use(q, loaded)`), the groups in increasing order: one load at a time, used
// before the next, kept too few bytes in flight for the memory's speed (on an H200: the head's loss
// gradient at 1.5 TB/s, GPT-2's casts of saved activations at 2.1, GELU's operand bits at 1.8,
// attention's operand rounding at 1.3-1.9). `grid_two_in_flight`: the grid's threads over them.
template <typename Load, typename Use>
__device__ __forceinline__ void two_in_flight(i64 first, i64 step, i64 groups, Load load, Use use) {
    i64 q = first;
    for (; q + step < groups; q += 2 * step) {
        const auto a = load(q), b = load(q + step);
        use(q, a);
        use(q + step, b);
    }
    if (q < groups) use(q, load(q));
}
template <typename Load, typename Use>
__device__ __forceinline__ void grid_two_in_flight(i64 groups, Load load, Use use) {
    two_in_flight((i64)blockIdx.x * blockDim.x + threadIdx.x, (i64)gridDim.x * blockDim.x, groups, load, use);
}

// Long f32 rows of a multiple of 4 values (GPT-2's 50,304 logits), a block a row: read 16 bytes a
// load, two loads in flight before either is used. One 4-byte load at a time, used before the
// next, kept about 8 KiB in flight a multiprocessor, and an H200 read a head chunk's logits at 1.5
// TB/s (cross-entropy's gradient, 873 us a chunk of 2,560 rows; the row maxima 2.2 TB/s). A
// thread still visits its elements in increasing order, so a run repeats bit for bit.
template <typename T>
struct Row4 {
    static_assert(sizeof(T) == 4, "rows of f32");
    // Whether a row of c values from `row` is read 16 bytes at a time.
    __device__ static bool fits(const T* row, i64 c) { return c % 4 == 0 && ((unsigned long long)row & 15) == 0; }
    // visit(j, v) over this thread's groups of four (elements j .. j + 3 in v) in increasing j, the
    // thread's groups blockDim.x apart, two groups loaded before they are visited.
    template <typename Visit>
    __device__ __forceinline__ static void scan(const T* row, i64 c, Visit visit) {
        const float4* r4 = (const float4*)row;
        two_in_flight(threadIdx.x, blockDim.x, c / 4, [&](i64 q) { return r4[q]; }, [&](i64 q, float4 v) { visit(4 * q, v); });
    }
};

// Four elements from j on into out: one 8-byte store of 16-bit ones (operand bits) or a 16-byte
// one of f32, as Row4 reads them (j a multiple of 4, out 16-byte aligned).
__device__ __forceinline__ void store4(unsigned short* out, i64 j, const unsigned short (&bits)[4]) {
    *(uint2*)(out + j) = make_uint2(bits[0] | (unsigned)bits[1] << 16, bits[2] | (unsigned)bits[3] << 16);
}
__device__ __forceinline__ void store4(float* out, i64 j, const float (&y)[4]) { *(float4*)(out + j) = make_float4(y[0], y[1], y[2], y[3]); }

// A running maximum and its index over elements visited in increasing index order: the first index
// of the largest, or of the first NaN, which wins and stays (max_dim's rule, PyTorch's).
template <typename T>
struct ArgMax {
    T m = T(0);
    i64 best = -1;
    // Whether a NaN was met: nothing after it counts.
    __device__ __forceinline__ bool done() const { return best >= 0 && m != m; }
    __device__ __forceinline__ void visit(i64 s, T v) {
        if (!done() && (best < 0 || v > m || v != v)) {
            m = v;
            best = s;
        }
    }
    // The block's threads' maxima merged in a fixed tree through vals and idxs (blockDim.x each, a
    // power of two): the first index of the largest, or of the first NaN, however the elements were
    // split among the threads. The result in vals[0] and idxs[0] (barriers before and after).
    __device__ void merge(T* vals, i64* idxs) const {
        vals[threadIdx.x] = m;
        idxs[threadIdx.x] = best;
        __syncthreads();
        for (unsigned h = blockDim.x / 2; h > 0; h >>= 1) {
            if (threadIdx.x < h) {
                const T a = vals[threadIdx.x], b = vals[threadIdx.x + h];
                const i64 ia = idxs[threadIdx.x], ib = idxs[threadIdx.x + h];
                const bool an = a != a, bn = b != b;
                bool take_b;
                if (ib < 0) take_b = false;
                else if (ia < 0) take_b = true;
                else if (an || bn) take_b = bn && (!an || ib < ia);
                else take_b = b > a || (b == a && ib < ia);
                if (take_b) {
                    vals[threadIdx.x] = b;
                    idxs[threadIdx.x] = ib;
                }
            }
            __syncthreads();
        }
    }
};
