// Reductions, each output computed by one thread or one block in a fixed order (no atomics).

// This thread's share of a row's max_dim_rows scan (ArgMax, common.cuh), ended at a NaN. Its
// elements are s = t, t + 256, ... (or Row4's groups, on a long f32 row): the block's merge finds
// the same answer either way.
template <typename T>
__device__ __forceinline__ void row_max(const T* row, i64 size, ArgMax<T>& a) {
    if constexpr (sizeof(T) == 4) {
        if (Row4<T>::fits(row, size)) {
            Row4<T>::scan(row, size, [&](i64 j, const float4& v) {
                a.visit(j, v.x);
                a.visit(j + 1, v.y);
                a.visit(j + 2, v.z);
                a.visit(j + 3, v.w);
            });
            return;
        }
    }
    for (i64 s = threadIdx.x; s < size && !a.done(); s += blockDim.x) a.visit(s, row[s]);
}

#define REDUCE(T, SUF)                                                                                  \
    /* x contiguous [outer, size, inner] -> out [outer, inner]: sum (or mean) over the middle dim,  \
       inner > 1. A block of 1024 threads per (o, 32 consecutive inner indices): lane = the index,  \
       each of the 32 warps sums every 32nd s, then the warps' partials are added in warp order. */  \
    extern "C" __global__ void sum_dim_cols_##SUF(const T* x, i64 outer, i64 size, i64 inner, int mean, T* out) { \
        __shared__ T part[32][33];                                                                      \
        i64 col_tiles = (inner + 31) / 32;                                                              \
        int lane = threadIdx.x % 32, group = threadIdx.x / 32;                                          \
        for (i64 t = blockIdx.x; t < outer * col_tiles; t += gridDim.x) {                               \
            i64 o = t / col_tiles, i = (t % col_tiles) * 32 + lane;                                     \
            T acc = T(0);                                                                               \
            if (i < inner)                                                                              \
                for (i64 s = group; s < size; s += 32) acc += x[(o * size + s) * inner + i];            \
            part[group][lane] = acc;                                                                    \
            __syncthreads();                                                                            \
            if (group == 0 && i < inner) {                                                              \
                T sum = T(0);                                                                           \
                for (int w = 0; w < 32; ++w) sum += part[w][lane];                                      \
                out[o * inner + i] = mean ? sum / T(size) : sum;                                        \
            }                                                                                           \
            __syncthreads();                                                                            \
        }                                                                                               \
    }                                                                                                   \
    /* The same with inner == 1: a block of 256 threads per contiguous row of `size` values. */         \
    extern "C" __global__ void sum_dim_rows_##SUF(const T* x, i64 outer, i64 size, int mean, T* out) {  \
        __shared__ T shared[256];                                                                       \
        for (i64 o = blockIdx.x; o < outer; o += gridDim.x) {                                           \
            T acc = T(0);                                                                               \
            for (i64 s = threadIdx.x; s < size; s += blockDim.x) acc += x[o * size + s];                \
            T sum = block_sum<T>(acc, shared);                                                          \
            if (threadIdx.x == 0) out[o] = mean ? sum / T(size) : sum;                                  \
        }                                                                                               \
    }                                                                                                   \
    /* out[j] = sum of x over the elements that broadcast from out's element j: x viewed through      \
       `groups` (the dims out keeps, strides of x) and `within` (the dims summed away). */             \
    extern "C" __global__ void sum_to_shape_##SUF(const T* x, Strided kept, Strided summed, i64 n_out, i64 n_sum, T* out) { \
        GRID_STRIDE(j, n_out) {                                                                         \
            i64 base = strided_offset(kept, j);                                                         \
            T acc = T(0);                                                                               \
            for (i64 s = 0; s < n_sum; ++s) acc += x[base + strided_offset(summed, s)];                 \
            out[j] = acc;                                                                               \
        }                                                                                               \
    }                                                                                                   \
    extern "C" __global__ void sum_backward_##SUF(const T* g, Strided gs, T scale, T* out, i64 n) {     \
        GRID_STRIDE(k, n) out[k] = g[strided_offset(gs, k)] * scale;                                    \
    }                                                                                                   \
    /* max over the middle dim with the first index of the max (NaN wins, as in PyTorch). */           \
    extern "C" __global__ void max_dim_##SUF(const T* x, i64 outer, i64 size, i64 inner, T* values, i64* indices) { \
        GRID_STRIDE(k, outer * inner) {                                                                 \
            i64 o = k / inner, i = k % inner, best = 0;                                                 \
            T m = x[o * size * inner + i];                                                              \
            for (i64 s = 1; s < size && m == m; ++s) {                                                  \
                T v = x[(o * size + s) * inner + i];                                                    \
                if (v > m || v != v) { m = v; best = s; }                                               \
            }                                                                                           \
            values[k] = m;                                                                              \
            indices[k] = best;                                                                          \
        }                                                                                               \
    }                                                                                                   \
    /* The same with inner == 1: a block of 256 threads per contiguous row of `size` values (a     \
       GPT-2 head's row has 50,304). Thread t scans its elements in order (row_max), then the block \
       merges the (value, index) pairs in a fixed tree; the merge keeps the first index of the max, \
       or of the first NaN, whatever the order, so the result is the per-column kernel's. */       \
    extern "C" __global__ void max_dim_rows_##SUF(const T* x, i64 outer, i64 size, T* values, i64* indices) { \
        __shared__ T vals[256];                                                                         \
        __shared__ i64 idxs[256];                                                                       \
        for (i64 o = blockIdx.x; o < outer; o += gridDim.x) {                                           \
            ArgMax<T> a;                                                                                \
            row_max(x + o * size, size, a);                                                             \
            a.merge(vals, idxs);                                                                        \
            if (threadIdx.x == 0) { values[o] = vals[0]; indices[o] = idxs[0]; }                        \
            __syncthreads();                                                                            \
        }                                                                                               \
    }                                                                                                   \
    extern "C" __global__ void max_dim_backward_##SUF(const T* g, const i64* idx, i64 outer, i64 size, i64 inner, T* out) { \
        GRID_STRIDE(k, outer * inner) {                                                                 \
            i64 o = k / inner, i = k % inner;                                                           \
            out[(o * size + idx[k]) * inner + i] += g[k];                                               \
        }                                                                                               \
    }                                                                                                   \
    /* One block of 1024 threads. */                                                                    \
    extern "C" __global__ void max_all_##SUF(const T* x, i64 n, T* out) {                              \
        __shared__ T shared[1024];                                                                      \
        T m = -INFINITY;                                                                                \
        for (i64 i = threadIdx.x; i < n; i += blockDim.x) m = (x[i] != x[i] || m != m) ? NAN : fmax(m, x[i]); \
        m = block_max<T>(m, shared);                                                                    \
        if (threadIdx.x == 0) *out = m;                                                                 \
    }                                                                                                   \
    /* The 0-d grad shared equally among the elements equal to the max (one block: counts first). */   \
    extern "C" __global__ void max_all_backward_##SUF(const T* x, const T* max, const T* g, i64 n, T* out) { \
        __shared__ T shared[1024];                                                                      \
        T count = T(0);                                                                                 \
        for (i64 i = threadIdx.x; i < n; i += blockDim.x) count += (x[i] == *max) ? T(1) : T(0);        \
        count = block_sum<T>(count, shared);                                                            \
        for (i64 i = threadIdx.x; i < n; i += blockDim.x) out[i] = (x[i] == *max) ? *g / count : T(0);  \
    }

REDUCE(float, f32)
REDUCE(double, f64)

// Column sums in two passes (common.cuh's column_partials): the first, of a dense [rows, cols]
// matrix; the second, out[j] (+= with accumulate) the partials of column j in split order
// (`column_finish`; `column_finish_two`: two such sums in one launch, a layer norm's weight and bias
// gradients, either out null when not wanted).
template <typename T>
__device__ __forceinline__ void finish_column(const T* part, i64 splits, i64 cols, i64 j, int accumulate, T* out) {
    T sum = T(0);
    for (i64 s = 0; s < splits; ++s) sum += part[s * cols + j];
    out[j] = accumulate ? out[j] + sum : sum;
}
#define COLUMNS(T, SUF)                                                                                 \
    extern "C" __global__ void column_partials_##SUF(const T* x, i64 rows, i64 cols, i64 per, T* part) { \
        column_partials<T>([=](i64 r, i64 j) { return Two<T>{x[r * cols + j], T(0)}; }, rows, cols, per, part, (T*)nullptr); \
    }                                                                                                   \
    extern "C" __global__ void column_finish_##SUF(const T* part, i64 splits, i64 cols, int accumulate, T* out) { \
        GRID_STRIDE(j, cols) finish_column<T>(part, splits, cols, j, accumulate, out);                  \
    }                                                                                                   \
    extern "C" __global__ void column_finish_two_##SUF(const T* part_a, T* out_a, const T* part_b, T* out_b, i64 splits, i64 cols, int accumulate) { \
        GRID_STRIDE(k, 2 * cols) {                                                                      \
            const bool b = k >= cols;                                                                   \
            T* out = b ? out_b : out_a;                                                                 \
            if (out) finish_column<T>(b ? part_b : part_a, splits, cols, b ? k - cols : k, accumulate, out); \
        }                                                                                               \
    }

COLUMNS(float, f32)
COLUMNS(double, f64)

// column_partials_f32's pass over an f32 output gradient that two products of KIND read (1: bf16,
// 2: fp16; Note [Held operands] in the cuda backend), each element's operand bits written into y
// (dense, as x) as it is added: the bias gradient's partials and the products' rounded copy from
// one reading of the gradient.
template <int KIND>
__device__ void column_partials_rounding(const float* x, i64 rows, i64 cols, i64 per, float* part, unsigned short* y) {
    const auto term = [=](i64 r, i64 j) {
        const float v = x[r * cols + j];
        y[r * cols + j] = (unsigned short)operand_bits<KIND>(v);
        return Two<float>{v, 0.0f};
    };
    column_partials<float>(term, rows, cols, per, part, (float*)nullptr);
}
extern "C" __global__ void column_partials_rounding_bf16(const float* x, i64 rows, i64 cols, i64 per, float* part, unsigned short* y) {
    column_partials_rounding<1>(x, rows, cols, per, part, y);
}
extern "C" __global__ void column_partials_rounding_f16(const float* x, i64 rows, i64 cols, i64 per, float* part, unsigned short* y) {
    column_partials_rounding<2>(x, rows, cols, per, part, y);
}

/* How many of the n int64 values of a equal b's, into *out (one block; a prediction count). */
extern "C" __global__ void count_equal_i64(const i64* a, const i64* b, i64 n, i64* out) {
    __shared__ i64 shared[1024];
    i64 count = 0;
    for (i64 i = threadIdx.x; i < n; i += blockDim.x) count += a[i] == b[i] ? 1 : 0;
    count = block_sum<i64>(count, shared);
    if (threadIdx.x == 0) *out = count;
}
