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

__device__ __forceinline__ i64 strided_offset(const Strided& s, i64 k) {
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
