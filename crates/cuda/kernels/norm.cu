// Layer norm over rows of d elements: one block (256 threads) per row for the statistics, output
// and input gradient, or for f32 rows that fit a warp's registers a warp per row (below); the
// weight and bias gradients as column sums, a block per 32 columns (warp partials in shared
// memory, added in a fixed order: deterministic, nothing to allocate).

// A warp a row, for f32 rows of d <= 128 x WARP_ROW_GROUPS elements (d a multiple of 4, every row and
// vector 16-byte aligned: `warp_rows`): lane l holds the row's groups of four l, l + 32, ... in
// registers, read once, 16 bytes a load, all of them in flight together; a sum is the lane's
// elements in order, then the lanes' by halves (xor 16, 8, 4, 2, 1: every lane adds the same two
// values, so all agree). A block per row took three readings of the row and sixteen barriers for
// its two sums: latency, not bandwidth, set its time (GPT-2's 4,096 x 768 blocks at 0.8 TB/s on an
// H200). The launcher gives such rows a warp each (`by_warps` in the cuda backend: the same test but
// for the alignment, which every allocator block has; any grid is correct, only slower).
#define WARP_ROW_GROUPS 8
template <typename X>
__device__ __forceinline__ bool warp_rows(i64 d, X x, const void* b, const void* c, const void* e) {
    const u64 any = (u64)b | (u64)c | (u64)e;
    return d % 4 == 0 && d <= 128 * WARP_ROW_GROUPS && fits4(x) && (any & 15) == 0;
}
__device__ __forceinline__ float warp_sum(float v) {
    for (int m = 16; m > 0; m /= 2) v += __shfl_xor_sync(0xffffffffu, v, m);
    return v;
}
// The warp's row r and its lane's part of it.
struct WarpRow {
    float4 v[WARP_ROW_GROUPS];
    // Group k of the lane is the row's group lane + 32 k, when inside it.
    __device__ static bool has(int k, i64 d) { return (i64)(threadIdx.x % 32) + 32 * k < d / 4; }
    __device__ static i64 at(int k) { return 4 * ((i64)(threadIdx.x % 32) + 32 * k); }
    // The lane's groups of a row of X (common.cuh's f32 operands: in place, or saved in 16 bits).
    template <typename X>
    __device__ void load(X row, i64 d) {
#pragma unroll
        for (int k = 0; k < WARP_ROW_GROUPS; ++k) v[k] = has(k, d) ? at4(row, at(k) / 4) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
    // visit(k, j, xs) for the lane's groups inside the row, in order: k the group, j its first
    // element's column, xs its four values.
    template <typename Visit>
    __device__ __forceinline__ void each(i64 d, Visit visit) const {
#pragma unroll
        for (int k = 0; k < WARP_ROW_GROUPS; ++k)
            if (has(k, d)) {
                const float xs[4] = {v[k].x, v[k].y, v[k].z, v[k].w};
                visit(k, at(k), xs);
            }
    }
};
// Rows of warps over the grid: warp w of block b takes rows b * warps_per_block + w, then a grid's
// worth of warps on.
#define WARP_ROWS(r, rows)                                                                                \
    for (i64 r = (i64)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; r < (rows); r += (i64)gridDim.x * (blockDim.x / 32))

// layer_norm_rows_t's rows, a warp each (the same formulas: the mean, then the mean of the squared
// deviations from it, then y = (x - mean) rstd w + b).
template <typename O, typename Store>
__device__ void layer_norm_warps(const float* x, const float* w, const float* b, i64 rows, i64 d, float eps, O* out, float* mean, float* rstd, Store store) {
    WARP_ROWS(r, rows) {
        WarpRow row;
        row.load(x + r * d, d);
        float s = 0.0f;
        row.each(d, [&](int, i64, const float (&xs)[4]) {
            for (int e = 0; e < 4; ++e) s += xs[e];
        });
        const float mu = warp_sum(s) / float(d);
        float q = 0.0f;
        row.each(d, [&](int, i64, const float (&xs)[4]) {
            for (int e = 0; e < 4; ++e) q += (xs[e] - mu) * (xs[e] - mu);
        });
        const float rs = 1.0f / sqrt(warp_sum(q) / float(d) + eps);
        row.each(d, [&](int, i64 j, const float (&xs)[4]) {
            O y[4];
            for (int e = 0; e < 4; ++e) {
                float t = (xs[e] - mu) * rs;
                if (w) t *= w[j + e];
                if (b) t += b[j + e];
                y[e] = store(t);
            }
            store4(out + r * d, j, y);
        });
        if (threadIdx.x % 32 == 0) {
            if (mean) mean[r] = mu;
            if (rstd) rstd[r] = rs;
        }
    }
}

// layer_norm_backward_x's rows, a warp each (its formula), x and g read once.
template <typename X>
__device__ void layer_norm_backward_x_warps(X x, const float* w, const float* mean, const float* rstd, const float* g, i64 rows, i64 d, float* gx) {
    WARP_ROWS(r, rows) {
        WarpRow xr, gr;
        xr.load(offset(x, r * d), d);
        gr.load(g + r * d, d);
        const float mu = mean[r], rs = rstd[r];
        float s1 = 0.0f, s2 = 0.0f;
        // g's group k as the four values of its lane.
        const auto gs = [&](int k, int e) { return e == 0 ? gr.v[k].x : e == 1 ? gr.v[k].y : e == 2 ? gr.v[k].z : gr.v[k].w; };
        xr.each(d, [&](int k, i64 j, const float (&xs)[4]) {
            for (int e = 0; e < 4; ++e) {
                const float gw = gs(k, e) * (w ? w[j + e] : 1.0f);
                s1 += gw;
                s2 += gw * (xs[e] - mu) * rs;
            }
        });
        s1 = warp_sum(s1) / float(d);
        s2 = warp_sum(s2) / float(d);
        xr.each(d, [&](int k, i64 j, const float (&xs)[4]) {
            float y[4];
            for (int e = 0; e < 4; ++e) {
                const float xhat = (xs[e] - mu) * rs, gw = gs(k, e) * (w ? w[j + e] : 1.0f);
                y[e] = rs * (gw - s1 - xhat * s2);
            }
            store4(gx + r * d, j, y);
        });
    }
}

// The rows' statistics and output, each output element y stored as store(y) (itself; or, for a
// product that alone reads it, its rounded operand bits: layer_norm_operands_*).
template <typename T, typename O, typename Store>
__device__ void layer_norm_rows_t(const T* x, const T* w, const T* b, i64 rows, i64 d, T eps, O* out, T* mean, T* rstd, Store store) {
    if constexpr (sizeof(T) == 4) {
        if (warp_rows(d, x, w, b, out)) return layer_norm_warps(x, w, b, rows, d, eps, out, mean, rstd, store);
    }
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
// layer_norm_apply_t's rows, a warp each.
template <typename X, typename O, typename Store>
__device__ void layer_norm_apply_warps(X x, const float* w, const float* b, const float* mean, const float* rstd, i64 rows, i64 d, O* out, Store store) {
    WARP_ROWS(r, rows) {
        WarpRow row;
        row.load(offset(x, r * d), d);
        const float mu = mean[r], rs = rstd[r];
        row.each(d, [&](int, i64 j, const float (&xs)[4]) {
            O y[4];
            for (int e = 0; e < 4; ++e) y[e] = store((xs[e] - mu) * rs * w[j + e] + b[j + e]);
            store4(out + r * d, j, y);
        });
    }
}

// out = (x - mean) * rstd * w + b from saved statistics (element-wise; w and b given), stored as
// above; x a T operand (common.cuh's: in place, or f32 saved in 16 bits).
template <typename T, typename X, typename O, typename Store>
__device__ void layer_norm_apply_t(X x, const T* w, const T* b, const T* mean, const T* rstd, i64 rows, i64 d, O* out, Store store) {
    if constexpr (sizeof(T) == 4) {
        if (warp_rows(d, x, w, b, out)) return layer_norm_apply_warps(x, w, b, mean, rstd, rows, d, out, store);
    }
    GRID_STRIDE(k, rows * d) {
        i64 r = k / d, j = k % d;
        out[k] = store((at1(x, k) - mean[r]) * rstd[r] * w[j] + b[j]);
    }
}

// layer_norm_backward_x_warps where its rows fit (and true), for f32; f64 rows never do.
template <typename X>
__device__ __forceinline__ bool backward_x_by_warps(X x, const float* w, const float* mean, const float* rstd, const float* g, i64 rows, i64 d, float* gx) {
    if (!warp_rows(d, x, w, g, gx)) return false;
    layer_norm_backward_x_warps(x, w, mean, rstd, g, rows, d, gx);
    return true;
}
__device__ __forceinline__ bool backward_x_by_warps(const double*, const double*, const double*, const double*, const double*, i64, i64, double*) { return false; }

// gx = rstd * (g w - mean(g w) - xhat * mean(g w xhat)), x a T operand (as layer_norm_apply_t's).
template <typename T, typename X>
__device__ void layer_norm_backward_x_t(X x, const T* w, const T* mean, const T* rstd, const T* g, i64 rows, i64 d, T* gx) {
    if (backward_x_by_warps(x, w, mean, rstd, g, rows, d, gx)) return;
    __shared__ T shared[256];
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        T mu = mean[r], rs = rstd[r], s1 = T(0), s2 = T(0);
        for (i64 j = threadIdx.x; j < d; j += blockDim.x) {
            T gw = g[r * d + j] * (w ? w[j] : T(1));
            s1 += gw;
            s2 += gw * (at1(x, r * d + j) - mu) * rs;
        }
        s1 = block_sum<T>(s1, shared) / T(d);
        s2 = block_sum<T>(s2, shared) / T(d);
        for (i64 j = threadIdx.x; j < d; j += blockDim.x) {
            T xhat = (at1(x, r * d + j) - mu) * rs;
            T gw = g[r * d + j] * (w ? w[j] : T(1));
            gx[r * d + j] = rs * (gw - s1 - xhat * s2);
        }
    }
}

// The weight and bias gradients as column sums: a block of 1024 threads per 32 columns, each of its
// 32 warps summing every 32nd row, the warps' partials added in warp order. accumulate: add to gw
// and gb (a later block of rows) instead of writing them. x a T operand (as layer_norm_apply_t's).
template <typename T, typename X>
__device__ void layer_norm_backward_wb_t(X x, const T* mean, const T* rstd, const T* g, i64 rows, i64 d, T* gw, T* gb, int accumulate) {
    __shared__ T part_w[32][33];
    __shared__ T part_b[32][33];
    int lane = threadIdx.x % 32, group = threadIdx.x / 32;
    for (i64 j0 = (i64)blockIdx.x * 32; j0 < d; j0 += (i64)gridDim.x * 32) {
        i64 j = j0 + lane;
        T sw = T(0), sb = T(0);
        if (j < d)
            for (i64 r = group; r < rows; r += 32) {
                T gi = g[r * d + j];
                sw += gi * (at1(x, r * d + j) - mean[r]) * rstd[r];
                sb += gi;
            }
        part_w[group][lane] = sw;
        part_b[group][lane] = sb;
        __syncthreads();
        if (group == 0 && j < d) {
            T tw = T(0), tb = T(0);
            for (int w = 0; w < 32; ++w) {
                tw += part_w[w][lane];
                tb += part_b[w][lane];
            }
            if (gw) gw[j] = accumulate ? gw[j] + tw : tw;
            if (gb) gb[j] = accumulate ? gb[j] + tb : tb;
        }
        __syncthreads();
    }
}

// The weight and bias gradients' first pass (common.cuh's column_partials; reduce.cu's
// column_finish adds the partials): the terms g (x - mean) rstd and g of each element, into part_w
// and part_b (either null when not wanted); x a T operand (as layer_norm_apply_t's).
template <typename T, typename X>
__device__ void layer_norm_wb_partials_t(X x, const T* mean, const T* rstd, const T* g, i64 rows, i64 d, i64 per, T* part_w, T* part_b) {
    column_partials<T>([=](i64 r, i64 j) { T gi = g[r * d + j]; return Two<T>{gi * (at1(x, r * d + j) - mean[r]) * rstd[r], gi}; }, rows, d, per, part_w, part_b);
}

#define LAYER_NORM(T, SUF)                                                                              \
    extern "C" __global__ void layer_norm_##SUF(const T* x, const T* w, const T* b, i64 rows, i64 d, T eps, T* out, T* mean, T* rstd) { \
        layer_norm_rows_t<T>(x, w, b, rows, d, eps, out, mean, rstd, [](T y) { return y; });            \
    }                                                                                                   \
    extern "C" __global__ void layer_norm_backward_x_##SUF(const T* x, const T* w, const T* mean, const T* rstd, const T* g, i64 rows, i64 d, T* gx) { \
        layer_norm_backward_x_t<T>(x, w, mean, rstd, g, rows, d, gx);                                   \
    }                                                                                                   \
    extern "C" __global__ void layer_norm_backward_wb_##SUF(const T* x, const T* mean, const T* rstd, const T* g, i64 rows, i64 d, T* gw, T* gb, int accumulate) { \
        layer_norm_backward_wb_t<T>(x, mean, rstd, g, rows, d, gw, gb, accumulate);                      \
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
#define LAYER_NORM_PARTIALS(T, SUF)                                                                     \
    extern "C" __global__ void layer_norm_wb_partials_##SUF(const T* x, const T* mean, const T* rstd, const T* g, i64 rows, i64 d, i64 per, T* part_w, T* part_b) { \
        layer_norm_wb_partials_t<T>(x, mean, rstd, g, rows, d, per, part_w, part_b);                    \
    }

LAYER_NORM_PARTIALS(float, f32)
LAYER_NORM_PARTIALS(double, f64)

// Layer-norm-linear's backward on a GPU with its input x saved in the products' own 16 bits (KIND
// 1: bfloat16, 2: binary16), read as saved (common.cuh's Saved16: each element widened as
// restoring it would, so the bits of the f32 kernels on the restored copy, without the copy):
// layer_norm_apply_operands_*, layer_norm_backward_x_f32, the weight and bias gradients' sums.
#define LAYER_NORM_SAVED(KIND, SUF)                                                                     \
    extern "C" __global__ void layer_norm_apply_operands_saved_##SUF(const unsigned short* x, const float* w, const float* b, const float* mean, const float* rstd, i64 rows, i64 d, unsigned short* out) { \
        layer_norm_apply_t<float>(Saved16<KIND>{x}, w, b, mean, rstd, rows, d, out, [](float y) { return (unsigned short)operand_bits<KIND>(y); }); \
    }                                                                                                   \
    extern "C" __global__ void layer_norm_backward_x_saved_##SUF(const unsigned short* x, const float* w, const float* mean, const float* rstd, const float* g, i64 rows, i64 d, float* gx) { \
        layer_norm_backward_x_t<float>(Saved16<KIND>{x}, w, mean, rstd, g, rows, d, gx);                \
    }                                                                                                   \
    extern "C" __global__ void layer_norm_backward_wb_saved_##SUF(const unsigned short* x, const float* mean, const float* rstd, const float* g, i64 rows, i64 d, float* gw, float* gb, int accumulate) { \
        layer_norm_backward_wb_t<float>(Saved16<KIND>{x}, mean, rstd, g, rows, d, gw, gb, accumulate);  \
    }                                                                                                   \
    extern "C" __global__ void layer_norm_wb_partials_saved_##SUF(const unsigned short* x, const float* mean, const float* rstd, const float* g, i64 rows, i64 d, i64 per, float* part_w, float* part_b) { \
        layer_norm_wb_partials_t<float>(Saved16<KIND>{x}, mean, rstd, g, rows, d, per, part_w, part_b);  \
    }

LAYER_NORM_SAVED(1, bf16)
LAYER_NORM_SAVED(2, f16)

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
