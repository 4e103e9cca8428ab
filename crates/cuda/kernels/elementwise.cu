// Element-wise ops: unary (and their backward), affine, pow by a number and clamp (and their
// backward), broadcasting binary,
// comparisons (codes: 0 gt, 1 lt, 2 ge, 3 le, 4 eq, 5 ne) and selection, add_into.
// Unary codes follow memfit's `Unary`: 0 relu, 1 gelu (erf), 2 gelu_tanh, 3 tanh, 4 sigmoid,
// 5 exp, 6 log, 7 neg, 8 relu6, 9 hardsigmoid, 10 hardswish, 11 sqrt, 12 rsqrt, 13 cos, 14 sin,
// 15 abs, 16 silu. Binary codes: 0 add, 1 sub, 2 mul, 3 div.

#define INV_SQRT2 0.70710678118654752440
#define INV_SQRT_2PI 0.39894228040143267794
#define SQRT_2_OVER_PI 0.79788456080286535588

template <typename T>
__device__ T unary_of(int op, T x) {
    switch (op) {
        case 0: return x > T(0) ? x : T(0);
        case 1: return T(0.5) * x * (T(1) + erf(x * T(INV_SQRT2)));
        case 2: return T(0.5) * x * (T(1) + tanh(T(SQRT_2_OVER_PI) * (x + T(0.044715) * x * x * x)));
        case 3: return tanh(x);
        case 4: return T(1) / (T(1) + exp(-x));
        case 5: return exp(x);
        case 6: return log(x);
        case 8: return x > T(0) ? (x < T(6) ? x : T(6)) : T(0);
        case 9: {
            T t = x + T(3);
            return (t > T(0) ? (t < T(6) ? t : T(6)) : T(0)) / T(6);
        }
        case 10: {
            T t = x + T(3);
            return x * (t > T(0) ? (t < T(6) ? t : T(6)) : T(0)) / T(6);
        }
        case 11: return sqrt(x);
        case 12: return T(1) / sqrt(x);
        case 13: return cos(x);
        case 14: return sin(x);
        case 15: return x < T(0) ? -x : x;
        case 16: return x / (T(1) + exp(-x));
        default: return -x;
    }
}

// The derivative's factor from the saved value `s` (the output for relu, tanh, sigmoid, exp, relu6,
// sqrt, rsqrt; the input for gelu, gelu_tanh, log, hardsigmoid, hardswish, cos, sin, abs, silu;
// nothing for neg).
template <typename T>
__device__ T unary_grad(int op, T s, T g) {
    switch (op) {
        case 0: return s > T(0) ? g : T(0);
        case 1: {
            T cdf = T(0.5) * (T(1) + erf(s * T(INV_SQRT2)));
            T pdf = T(INV_SQRT_2PI) * exp(T(-0.5) * s * s);
            return g * (cdf + s * pdf);
        }
        case 2: {
            T inner = T(SQRT_2_OVER_PI) * (s + T(0.044715) * s * s * s);
            T t = tanh(inner);
            T d_inner = T(SQRT_2_OVER_PI) * (T(1) + T(3) * T(0.044715) * s * s);
            return g * (T(0.5) * (T(1) + t) + T(0.5) * s * (T(1) - t * t) * d_inner);
        }
        case 3: return g * (T(1) - s * s);
        case 4: return g * s * (T(1) - s);
        case 5: return g * s;
        case 6: return g / s;
        case 8: return s > T(0) && s < T(6) ? g : T(0);
        case 9: return s > T(-3) && s < T(3) ? g / T(6) : T(0);
        case 10: return s < T(-3) ? T(0) : (s <= T(3) ? g * (s / T(3) + T(0.5)) : g);
        case 11: return g / (T(2) * s);
        case 12: return T(-0.5) * g * (s * s * s);
        case 13: return g * -sin(s);
        case 14: return g * cos(s);
        case 15: return s > T(0) ? g : (s < T(0) ? -g : T(0));
        case 16: {
            T sig = T(1) / (T(1) + exp(-s));
            return g * sig * (T(1) + s * (T(1) - sig));
        }
        default: return -g;
    }
}

template <typename T>
__device__ T binary_of(int op, T a, T b) {
    switch (op) {
        case 0: return a + b;
        case 1: return a - b;
        case 2: return a * b;
        default: return a / b;
    }
}

template <typename T>
__device__ unsigned char compare_of(int op, T a, T b) {
    switch (op) {
        case 0: return a > b;
        case 1: return a < b;
        case 2: return a >= b;
        case 3: return a <= b;
        case 4: return a == b;
        default: return a != b;
    }
}

// map2's operands as it reads them: a null f32 one (a unary op's backward that reads no saved
// input) as zeros.
__device__ __forceinline__ float4 or_zeros4(const float* a, i64 q) { return a ? at4(a, q) : make_float4(0.0f, 0.0f, 0.0f, 0.0f); }
template <int KIND>
__device__ __forceinline__ float4 or_zeros4(Saved16<KIND> a, i64 q) {
    return at4(a, q);
}
__device__ __forceinline__ float or_zero(const float* a, i64 k) { return a ? a[k] : 0.0f; }
template <int KIND>
__device__ __forceinline__ float or_zero(Saved16<KIND> a, i64 k) {
    return at1(a, k);
}

// out[i] = f(a[i], b[i]) over f32 arrays (a: an f32 operand, common.cuh's Saved16; a null one
// reads zeros), out possibly a or b itself (each element read before it is written, by the thread that
// writes it). Four elements a thread a step where all three fit four a load, two steps' loads in
// flight (GPT-2's GELU backward, one element a thread, ran at 3.1 TB/s on an H200); the rest one
// at a time. The same bits either way.
template <typename A, typename F>
__device__ void map2(A a, const float* b, float* out, i64 n, F f) {
    const bool wide = fits4(a) && fits4(b) && fits4(out);
    const i64 n4 = wide ? n / 4 : 0;
    grid_two_in_flight(n4, [&](i64 q) { return Two<float4>{or_zeros4(a, q), or_zeros4(b, q)}; }, [&](i64 q, Two<float4> uv) {
        const float4 u = uv.a, v = uv.b;
        ((float4*)out)[q] = make_float4(f(u.x, v.x), f(u.y, v.y), f(u.z, v.z), f(u.w, v.w));
    });
    GRID_STRIDE(i, n - 4 * n4) {
        const i64 k = 4 * n4 + i;
        out[k] = f(or_zero(a, k), or_zero(b, k));
    }
}
// The unary kernels' loops: map2's for f32, an element a thread for f64.
__device__ __forceinline__ void unary_all(int op, const float* x, float* out, i64 n) {
    map2(x, nullptr, out, n, [=](float v, float) { return unary_of<float>(op, v); });
}
__device__ __forceinline__ void unary_all(int op, const double* x, double* out, i64 n) {
    GRID_STRIDE(i, n) out[i] = unary_of<double>(op, x[i]);
}
template <typename A>
__device__ __forceinline__ void unary_backward_all(int op, A saved, const float* g, float* out, i64 n) {
    map2(saved, g, out, n, [=](float s, float gi) { return unary_grad<float>(op, s, gi); });
}
__device__ __forceinline__ void unary_backward_all(int op, const double* saved, const double* g, double* out, i64 n) {
    GRID_STRIDE(i, n) out[i] = unary_grad<double>(op, saved ? saved[i] : 0.0, g[i]);
}
// unary_backward_f32 of an input saved in 16 bits (map2's Saved16).
extern "C" __global__ void unary_backward_saved_bf16(int op, const unsigned short* saved, const float* g, float* out, i64 n) {
    unary_backward_all(op, Saved16<1>{saved}, g, out, n);
}
extern "C" __global__ void unary_backward_saved_f16(int op, const unsigned short* saved, const float* g, float* out, i64 n) {
    unary_backward_all(op, Saved16<2>{saved}, g, out, n);
}

#define FLOAT_KERNELS(T, SUF)                                                                          \
    extern "C" __global__ void unary_##SUF(int op, const T* x, T* out, i64 n) { unary_all(op, x, out, n); } \
    extern "C" __global__ void unary_backward_##SUF(int op, const T* saved, const T* g, T* out, i64 n) { \
        unary_backward_all(op, saved, g, out, n);                                                      \
    }                                                                                                  \
    extern "C" __global__ void affine_##SUF(const T* x, T scale, T shift, T* out, i64 n) {            \
        GRID_STRIDE(i, n) out[i] = x[i] * scale + shift;                                               \
    }                                                                                                  \
    /* a and b as strided views broadcast to out's shape (stride 0 along broadcast dims). */           \
    extern "C" __global__ void binary_##SUF(int op, const T* a, Strided sa, const T* b, Strided sb, T* out, i64 n) { \
        GRID_STRIDE(k, n) out[k] = binary_of<T>(op, a[strided_offset(sa, k)], b[strided_offset(sb, k)]); \
    }                                                                                                  \
    extern "C" __global__ void add_into_##SUF(T* dst, const T* src, i64 n) {                          \
        GRID_STRIDE(i, n) dst[i] += src[i];                                                            \
    }                                                                                                  \
    /* dst and src as strided views of one shape; dst's elements are distinct (a window of a tensor). */ \
    extern "C" __global__ void add_into_strided_##SUF(T* dst, Strided sd, const T* src, Strided ss, i64 n) { \
        GRID_STRIDE(k, n) dst[strided_offset(sd, k)] += src[strided_offset(ss, k)];                   \
    }                                                                                                  \
    extern "C" __global__ void pow_scalar_##SUF(const T* x, T e, T* out, i64 n) {                    \
        GRID_STRIDE(i, n) out[i] = pow(x[i], e);                                                       \
    }                                                                                                  \
    /* out may be g itself: each element is read before it is written. */                              \
    extern "C" __global__ void pow_scalar_backward_##SUF(const T* x, T e, const T* g, T* out, i64 n) { \
        GRID_STRIDE(i, n) out[i] = e == T(0) ? T(0) : g[i] * e * pow(x[i], e - T(1));                   \
    }                                                                                                  \
    extern "C" __global__ void clamp_##SUF(const T* x, T lo, T hi, T* out, i64 n) {                   \
        GRID_STRIDE(i, n) out[i] = x[i] < lo ? lo : (x[i] > hi ? hi : x[i]);                           \
    }                                                                                                  \
    /* out may be g itself: each element is read before it is written. */                              \
    extern "C" __global__ void clamp_backward_##SUF(const T* x, T lo, T hi, int inclusive, const T* g, T* out, i64 n) { \
        GRID_STRIDE(i, n) {                                                                            \
            T v = x[i];                                                                                \
            bool inside = inclusive ? (v >= lo && v <= hi) : (v > lo && v < hi);                       \
            out[i] = inside ? g[i] : T(0);                                                             \
        }                                                                                              \
    }                                                                                                  \
    extern "C" __global__ void compare_##SUF(int op, const T* a, Strided sa, const T* b, Strided sb, unsigned char* out, i64 n) { \
        GRID_STRIDE(k, n) out[k] = compare_of<T>(op, a[strided_offset(sa, k)], b[strided_offset(sb, k)]); \
    }                                                                                                  \
    extern "C" __global__ void select_##SUF(const unsigned char* c, Strided sc, const T* a, Strided sa, const T* b, Strided sb, T* out, i64 n) { \
        GRID_STRIDE(k, n) out[k] = c[strided_offset(sc, k)] ? a[strided_offset(sa, k)] : b[strided_offset(sb, k)]; \
    }

FLOAT_KERNELS(float, f32)
FLOAT_KERNELS(double, f64)

// unary_f32 then the rounding of a product's operand (KIND 1: bfloat16, 2: binary16; common.cuh's
// operand_bits, as round_operands gives them): y[i] the operand bits of op(x[i]), for an activation
// only a product reads (GELU-linear's block on a GPU: one 16-bit write, where the f32 block was
// written, read and rounded into the rounding workspace). x: an f32 operand, in place or saved in
// the products' own 16 bits (common.cuh's Saved16) (`unary_operands_saved_*`: GELU-linear's backward).
//
// Four elements a step where x fits four a load and y is 8-byte aligned (an 8-byte store), two
// steps' loads issued before either is computed: a thread reading one f32 at a time kept too few
// bytes in flight to reach the memory's speed (GPT-2's GELU blocks at 1.8 TB/s on an H200). Each
// element's bits are the one-at-a-time loop's, which takes the rest.
template <int KIND, typename A>
__device__ void unary_operands(int op, A x, unsigned short* y, i64 n) {
    const bool wide = fits4(x) && ((u64)y & 7) == 0;
    const i64 n4 = wide ? n / 4 : 0;
    grid_two_in_flight(n4, [&](i64 q) { return at4(x, q); }, [&](i64 q, float4 v) {
        ((uint2*)y)[q] = make_uint2(operand_pair<KIND>(unary_of<float>(op, v.x), unary_of<float>(op, v.y)),
                                    operand_pair<KIND>(unary_of<float>(op, v.z), unary_of<float>(op, v.w)));
    });
    GRID_STRIDE(i, n - 4 * n4) y[4 * n4 + i] = (unsigned short)operand_bits<KIND>(unary_of<float>(op, at1(x, 4 * n4 + i)));
}
extern "C" __global__ void unary_operands_bf16(int op, const float* x, unsigned short* y, i64 n) { unary_operands<1>(op, x, y, n); }
extern "C" __global__ void unary_operands_f16(int op, const float* x, unsigned short* y, i64 n) { unary_operands<2>(op, x, y, n); }
extern "C" __global__ void unary_operands_saved_bf16(int op, const unsigned short* x, unsigned short* y, i64 n) {
    unary_operands<1>(op, Saved16<1>{x}, y, n);
}
extern "C" __global__ void unary_operands_saved_f16(int op, const unsigned short* x, unsigned short* y, i64 n) {
    unary_operands<2>(op, Saved16<2>{x}, y, n);
}
