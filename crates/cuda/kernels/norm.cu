// Layer norm over rows of d elements: one block (256 threads) per row for the statistics, output
// and input gradient; the weight and bias gradients as column sums, a block per 32 columns (warp
// partials in shared memory, added in a fixed order: deterministic, nothing to allocate).

// The rows' statistics and output, each output element y stored as store(y) (itself; or, for a
// product that alone reads it, its rounded operand bits: layer_norm_operands_*).
template <typename T, typename O, typename Store>
__device__ void layer_norm_rows_t(const T* x, const T* w, const T* b, i64 rows, i64 d, T eps, O* out, T* mean, T* rstd, Store store) {
    __shared__ T shared[256];
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const T* row = x + r * d;
        T s = T(0);
        for (i64 j = threadIdx.x; j < d; j += blockDim.x) s += row[j];
        T mu = block_sum<T>(s, shared) / T(d);
        T q = T(0);
        for (i64 j = threadIdx.x; j < d; j += blockDim.x) { T c = row[j] - mu; q += c * c; }
        T rs = T(1) / sqrt(block_sum<T>(q, shared) / T(d) + eps);
        for (i64 j = threadIdx.x; j < d; j += blockDim.x) {
            T y = (row[j] - mu) * rs;
            if (w) y *= w[j];
            if (b) y += b[j];
            out[r * d + j] = store(y);
        }
        if (threadIdx.x == 0) { if (mean) mean[r] = mu; if (rstd) rstd[r] = rs; }
    }
}
// out = (x - mean) * rstd * w + b from saved statistics (element-wise; w and b given), stored as above.
template <typename T, typename O, typename Store>
__device__ void layer_norm_apply_t(const T* x, const T* w, const T* b, const T* mean, const T* rstd, i64 rows, i64 d, O* out, Store store) {
    GRID_STRIDE(k, rows * d) {
        i64 r = k / d, j = k % d;
        out[k] = store((x[k] - mean[r]) * rstd[r] * w[j] + b[j]);
    }
}

#define LAYER_NORM(T, SUF)                                                                              \
    extern "C" __global__ void layer_norm_##SUF(const T* x, const T* w, const T* b, i64 rows, i64 d, T eps, T* out, T* mean, T* rstd) { \
        layer_norm_rows_t<T>(x, w, b, rows, d, eps, out, mean, rstd, [](T y) { return y; });            \
    }                                                                                                   \
    /* gx = rstd * (g w - mean(g w) - xhat * mean(g w xhat)). */                                        \
    extern "C" __global__ void layer_norm_backward_x_##SUF(const T* x, const T* w, const T* mean, const T* rstd, const T* g, i64 rows, i64 d, T* gx) { \
        __shared__ T shared[256];                                                                       \
        for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {                                            \
            T mu = mean[r], rs = rstd[r], s1 = T(0), s2 = T(0);                                         \
            for (i64 j = threadIdx.x; j < d; j += blockDim.x) {                                         \
                T gw = g[r * d + j] * (w ? w[j] : T(1));                                                \
                s1 += gw;                                                                               \
                s2 += gw * (x[r * d + j] - mu) * rs;                                                    \
            }                                                                                           \
            s1 = block_sum<T>(s1, shared) / T(d);                                                       \
            s2 = block_sum<T>(s2, shared) / T(d);                                                       \
            for (i64 j = threadIdx.x; j < d; j += blockDim.x) {                                         \
                T xhat = (x[r * d + j] - mu) * rs;                                                      \
                T gw = g[r * d + j] * (w ? w[j] : T(1));                                                \
                gx[r * d + j] = rs * (gw - s1 - xhat * s2);                                             \
            }                                                                                           \
        }                                                                                               \
    }                                                                                                   \
    /* The weight and bias gradients as column sums: a block of 1024 threads per 32 columns, each    \
       of its 32 warps summing every 32nd row, the warps' partials added in warp order.               \
       accumulate: add to gw and gb (a later block of rows) instead of writing them. */              \
    extern "C" __global__ void layer_norm_backward_wb_##SUF(const T* x, const T* mean, const T* rstd, const T* g, i64 rows, i64 d, T* gw, T* gb, int accumulate) { \
        __shared__ T part_w[32][33];                                                                    \
        __shared__ T part_b[32][33];                                                                    \
        int lane = threadIdx.x % 32, group = threadIdx.x / 32;                                          \
        for (i64 j0 = (i64)blockIdx.x * 32; j0 < d; j0 += (i64)gridDim.x * 32) {                        \
            i64 j = j0 + lane;                                                                          \
            T sw = T(0), sb = T(0);                                                                     \
            if (j < d)                                                                                  \
                for (i64 r = group; r < rows; r += 32) {                                                \
                    T gi = g[r * d + j];                                                                \
                    sw += gi * (x[r * d + j] - mean[r]) * rstd[r];                                      \
                    sb += gi;                                                                           \
                }                                                                                       \
            part_w[group][lane] = sw;                                                                   \
            part_b[group][lane] = sb;                                                                   \
            __syncthreads();                                                                            \
            if (group == 0 && j < d) {                                                                  \
                T tw = T(0), tb = T(0);                                                                 \
                for (int w = 0; w < 32; ++w) { tw += part_w[w][lane]; tb += part_b[w][lane]; }          \
                if (gw) gw[j] = accumulate ? gw[j] + tw : tw;                                           \
                if (gb) gb[j] = accumulate ? gb[j] + tb : tb;                                           \
            }                                                                                           \
            __syncthreads();                                                                            \
        }                                                                                               \
    }                                                                                                   \
    extern "C" __global__ void layer_norm_apply_##SUF(const T* x, const T* w, const T* b, const T* mean, const T* rstd, i64 rows, i64 d, T* out) { \
        layer_norm_apply_t<T>(x, w, b, mean, rstd, rows, d, out, [](T y) { return y; });                \
    }

LAYER_NORM(float, f32)
LAYER_NORM(double, f64)

// layer_norm_f32 and layer_norm_apply_f32 with each output element as a bf16 (KIND 1) or fp16 (2)
// product's operand bits (common.cuh's operand_bits, as round_operands gives them): the fused
// layer-norm-linear's block on a GPU, which only its product reads (one 2-byte write, where the f32
// block was written, read and rounded into the rounding workspace).
#define LAYER_NORM_OPERANDS(KIND, SUF)                                                                  \
    extern "C" __global__ void layer_norm_operands_##SUF(const float* x, const float* w, const float* b, i64 rows, i64 d, float eps, unsigned short* out, float* mean, float* rstd) { \
        layer_norm_rows_t<float>(x, w, b, rows, d, eps, out, mean, rstd, [](float y) { return (unsigned short)operand_bits<KIND>(y); }); \
    }                                                                                                   \
    extern "C" __global__ void layer_norm_apply_operands_##SUF(const float* x, const float* w, const float* b, const float* mean, const float* rstd, i64 rows, i64 d, unsigned short* out) { \
        layer_norm_apply_t<float>(x, w, b, mean, rstd, rows, d, out, [](float y) { return (unsigned short)operand_bits<KIND>(y); }); \
    }

LAYER_NORM_OPERANDS(1, bf16)
LAYER_NORM_OPERANDS(2, f16)

// Batch norm over channel dim 1 of x [nb, c, s...] (s = the spatial size): one block (256
// threads) per channel, statistics summed in double in a fixed order (as the cpu kernel sums in
// f64). Training uses the batch's mean and biased variance and updates the running statistics
// with the unbiased one; eval uses the running ones.
// The weight and bias gradients' first pass (common.cuh's column_partials; reduce.cu's
// column_finish adds the partials): the terms g (x - mean) rstd and g of each element, into part_w
// and part_b (either null when not wanted).
#define LAYER_NORM_PARTIALS(T, SUF)                                                                     \
    extern "C" __global__ void layer_norm_wb_partials_##SUF(const T* x, const T* mean, const T* rstd, const T* g, i64 rows, i64 d, i64 per, T* part_w, T* part_b) { \
        column_partials<T>([=](i64 r, i64 j) { T gi = g[r * d + j]; return Two<T>{gi * (x[r * d + j] - mean[r]) * rstd[r], gi}; }, rows, d, per, part_w, part_b); \
    }

LAYER_NORM_PARTIALS(float, f32)
LAYER_NORM_PARTIALS(double, f64)

#define BATCH_NORM(T, SUF)                                                                              \
    extern "C" __global__ void batch_norm_##SUF(const T* x, i64 nb, i64 c, i64 s, int training, double momentum, double eps, \
                                                T* running_mean, T* running_var, const T* w, const T* b, T* out, T* mean, T* rstd) { \
        __shared__ double shared[256];                                                                  \
        i64 n = nb * s;                                                                                 \
        for (i64 ch = blockIdx.x; ch < c; ch += gridDim.x) {                                            \
            double m, r;                                                                                \
            if (training) {                                                                             \
                double acc = 0.0;                                                                       \
                for (i64 k = threadIdx.x; k < n; k += blockDim.x) acc += (double)x[((k / s) * c + ch) * s + k % s]; \
                m = block_sum<double>(acc, shared) / (double)n;                                         \
                double q = 0.0;                                                                         \
                for (i64 k = threadIdx.x; k < n; k += blockDim.x) {                                     \
                    double d = (double)x[((k / s) * c + ch) * s + k % s] - m;                           \
                    q += d * d;                                                                         \
                }                                                                                       \
                double var = block_sum<double>(q, shared) / (double)n;                                  \
                if (threadIdx.x == 0 && running_mean && running_var) {                                  \
                    double unbias = (double)n / (double)(n - 1);                                        \
                    running_mean[ch] = (T)((1.0 - momentum) * (double)running_mean[ch] + momentum * m); \
                    running_var[ch] = (T)((1.0 - momentum) * (double)running_var[ch] + momentum * var * unbias); \
                }                                                                                       \
                r = 1.0 / sqrt(var + eps);                                                              \
            } else {                                                                                    \
                m = (double)running_mean[ch];                                                           \
                r = 1.0 / sqrt((double)running_var[ch] + eps);                                          \
            }                                                                                           \
            double alpha_d = r * (w ? (double)w[ch] : 1.0);                                             \
            T alpha = (T)alpha_d, beta = (T)((b ? (double)b[ch] : 0.0) - m * alpha_d);                  \
            for (i64 k = threadIdx.x; k < n; k += blockDim.x) {                                         \
                i64 at = ((k / s) * c + ch) * s + k % s;                                                \
                out[at] = x[at] * alpha + beta;                                                         \
            }                                                                                           \
            if (threadIdx.x == 0) { if (mean) mean[ch] = (T)m; if (rstd) rstd[ch] = (T)r; }             \
        }                                                                                               \
    }                                                                                                   \
    extern "C" __global__ void batch_norm_backward_##SUF(const T* x, const T* w, const T* mean, const T* rstd, int training, const T* g, \
                                                         i64 nb, i64 c, i64 s, T* gx, T* gw, T* gb) {   \
        __shared__ double shared[256];                                                                  \
        i64 n = nb * s;                                                                                 \
        for (i64 ch = blockIdx.x; ch < c; ch += gridDim.x) {                                            \
            T m = mean[ch], r = rstd[ch];                                                               \
            double sg = 0.0, sgx = 0.0;                                                                 \
            for (i64 k = threadIdx.x; k < n; k += blockDim.x) {                                         \
                i64 at = ((k / s) * c + ch) * s + k % s;                                                \
                sg += (double)g[at];                                                                    \
                sgx += (double)(g[at] * (x[at] - m) * r);                                               \
            }                                                                                           \
            sg = block_sum<double>(sg, shared);                                                         \
            sgx = block_sum<double>(sgx, shared);                                                       \
            if (threadIdx.x == 0) { if (gw) gw[ch] = (T)sgx; if (gb) gb[ch] = (T)sg; }                  \
            if (gx) {                                                                                   \
                T k_ = (T)((double)r * (w ? (double)w[ch] : 1.0));                                      \
                T a = (T)(sg / (double)n), bb = (T)(sgx / (double)n);                                   \
                for (i64 k = threadIdx.x; k < n; k += blockDim.x) {                                     \
                    i64 at = ((k / s) * c + ch) * s + k % s;                                            \
                    gx[at] = training ? k_ * (g[at] - a - (x[at] - m) * r * bb) : g[at] * k_;           \
                }                                                                                       \
            }                                                                                           \
        }                                                                                               \
    }

BATCH_NORM(float, f32)
BATCH_NORM(double, f64)
