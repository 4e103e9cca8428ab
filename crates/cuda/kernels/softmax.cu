// Softmax and log-softmax over the last dim of x viewed as [rows, d] (the op moves `dim` last or
// passes inner > 1: element (r, j) of row r = (o, i) is at (o * d + j) * inner + i). One block per
// row, 256 threads: max, sum of exponentials, then the outputs.

#define SOFTMAX(T, SUF)                                                                                 \
    extern "C" __global__ void softmax_##SUF(const T* x, i64 outer, i64 d, i64 inner, int log_, T* out) { \
        __shared__ T shared[256];                                                                       \
        for (i64 r = blockIdx.x; r < outer * inner; r += gridDim.x) {                                   \
            i64 o = r / inner, i = r % inner;                                                           \
            const T* row = x + o * d * inner + i;                                                       \
            T* dst = out + o * d * inner + i;                                                           \
            T m = -INFINITY;                                                                            \
            for (i64 j = threadIdx.x; j < d; j += blockDim.x) m = fmax(m, row[j * inner]);              \
            m = block_max<T>(m, shared);                                                                \
            T s = T(0);                                                                                 \
            for (i64 j = threadIdx.x; j < d; j += blockDim.x) s += exp(row[j * inner] - m);             \
            s = block_sum<T>(s, shared);                                                                \
            T lse = log(s);                                                                             \
            for (i64 j = threadIdx.x; j < d; j += blockDim.x)                                           \
                dst[j * inner] = log_ ? row[j * inner] - m - lse : exp(row[j * inner] - m) / s;         \
        }                                                                                               \
    }                                                                                                   \
    /* softmax: gx = y * (g - sum(g * y)); log_softmax: gx = g - exp(y) * sum(g). */                   \
    extern "C" __global__ void softmax_backward_##SUF(const T* y, const T* g, i64 outer, i64 d, i64 inner, int log_, T* gx) { \
        __shared__ T shared[256];                                                                       \
        for (i64 r = blockIdx.x; r < outer * inner; r += gridDim.x) {                                   \
            i64 base = (r / inner) * d * inner + r % inner;                                             \
            T s = T(0);                                                                                 \
            for (i64 j = threadIdx.x; j < d; j += blockDim.x) {                                         \
                i64 k = base + j * inner;                                                               \
                s += log_ ? g[k] : g[k] * y[k];                                                         \
            }                                                                                           \
            s = block_sum<T>(s, shared);                                                                \
            for (i64 j = threadIdx.x; j < d; j += blockDim.x) {                                         \
                i64 k = base + j * inner;                                                               \
                gx[k] = log_ ? g[k] - exp(y[k]) * s : y[k] * (g[k] - s);                                \
            }                                                                                           \
        }                                                                                               \
    }

SOFTMAX(float, f32)
SOFTMAX(double, f64)
