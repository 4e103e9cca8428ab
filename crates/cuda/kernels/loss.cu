// Losses, mean over rows summed in one block of 1024 threads so the sum's order is fixed. Cross-entropy
// first writes each row's loss (a block per row: a GPT-2 row has 50,304 logits) into the op's
// workspace of one value per row; nll and mse read one value per row and sum in the one block. A target outside [0, C) sets `*bad` to its
// row + 1 instead of reading out of bounds; the host reads it at the step's synchronisation.

#define LOSS(T, SUF)                                                                                    \
    /* Each row's loss into rowloss[r], a block of 256 threads per row. */                         \
    extern "C" __global__ void cross_entropy_rows_##SUF(const T* logits, const i64* target, i64 n, i64 c, T smoothing, T* rowloss, i64* bad) { \
        __shared__ T shared[256];                                                                       \
        for (i64 r = blockIdx.x; r < n; r += gridDim.x) {                                               \
            const T* row = logits + r * c;                                                              \
            i64 t = target[r];                                                                          \
            if (t < 0 || t >= c) {                                                                      \
                if (threadIdx.x == 0) { atomicCAS((u64*)bad, 0ULL, (u64)(r + 1)); rowloss[r] = T(0); }  \
                continue;                                                                               \
            }                                                                                           \
            T m = -INFINITY;                                                                            \
            for (i64 j = threadIdx.x; j < c; j += blockDim.x) m = fmax(m, row[j]);                      \
            m = block_max<T>(m, shared);                                                                \
            T s = T(0), total = T(0);                                                                   \
            for (i64 j = threadIdx.x; j < c; j += blockDim.x) { s += exp(row[j] - m); total += row[j]; } \
            s = block_sum<T>(s, shared);                                                                \
            total = block_sum<T>(total, shared);                                                        \
            /* (1 - eps) * (lse - x_t) + eps * (lse - mean_j x_j) */                                     \
            T lse = m + log(s);                                                                         \
            if (threadIdx.x == 0) rowloss[r] = (T(1) - smoothing) * (lse - row[t]) + smoothing * (lse - total / T(c)); \
        }                                                                                               \
    }                                                                                                   \
    /* The rows' mean, one block of 1024: thread i sums rows i, i + 1024, ..., then the block's tree. */ \
    extern "C" __global__ void cross_entropy_mean_##SUF(const T* rowloss, i64 n, T* out) {              \
        __shared__ T shared[1024];                                                                      \
        T acc = T(0);                                                                                   \
        for (i64 r = threadIdx.x; r < n; r += blockDim.x) acc += rowloss[r];                            \
        acc = block_sum<T>(acc, shared);                                                                \
        if (threadIdx.x == 0) *out = acc / T(n);                                                        \
    }                                                                                                   \
    /* gx[r, j] = g / n * (softmax_j - (1 - eps) [j == t] - eps / C), one block per row. */            \
    extern "C" __global__ void cross_entropy_backward_##SUF(const T* logits, const i64* target, i64 n, i64 c, T smoothing, const T* g, T* gx) { \
        __shared__ T shared[256];                                                                       \
        for (i64 r = blockIdx.x; r < n; r += gridDim.x) {                                               \
            const T* row = logits + r * c;                                                              \
            T m = -INFINITY;                                                                            \
            for (i64 j = threadIdx.x; j < c; j += blockDim.x) m = fmax(m, row[j]);                      \
            m = block_max<T>(m, shared);                                                                \
            T s = T(0);                                                                                 \
            for (i64 j = threadIdx.x; j < c; j += blockDim.x) s += exp(row[j] - m);                     \
            s = block_sum<T>(s, shared);                                                                \
            T scale = *g / T(n);                                                                        \
            i64 t = target[r];                                                                          \
            for (i64 j = threadIdx.x; j < c; j += blockDim.x) {                                         \
                T p = exp(row[j] - m) / s;                                                              \
                gx[r * c + j] = scale * (p - (j == t ? T(1) - smoothing : T(0)) - smoothing / T(c));    \
            }                                                                                           \
        }                                                                                               \
    }                                                                                                   \
    extern "C" __global__ void nll_loss_##SUF(const T* lp, Strided rows, i64 col_stride, const i64* target, i64 n, i64 c, T* out, i64* bad) { \
        __shared__ T shared[1024];                                                                      \
        T acc = T(0);                                                                                   \
        for (i64 r = threadIdx.x; r < n; r += blockDim.x) {                                             \
            i64 t = target[r];                                                                          \
            if (t < 0 || t >= c) { atomicCAS((u64*)bad, 0ULL, (u64)(r + 1)); continue; }                \
            acc -= lp[strided_offset(rows, r) + t * col_stride];                                        \
        }                                                                                               \
        acc = block_sum<T>(acc, shared);                                                                \
        if (threadIdx.x == 0) *out = acc / T(n);                                                        \
    }                                                                                                   \
    extern "C" __global__ void nll_loss_backward_##SUF(const i64* target, const T* g, i64 n, i64 c, T* gx) { \
        GRID_STRIDE(r, n) gx[r * c + target[r]] = -*g / T(n);                                           \
    }                                                                                                   \
    extern "C" __global__ void mse_loss_##SUF(const T* a, const T* b, i64 n, T* out) {                  \
        __shared__ T shared[1024];                                                                      \
        T acc = T(0);                                                                                   \
        for (i64 i = threadIdx.x; i < n; i += blockDim.x) { T d = a[i] - b[i]; acc += d * d; }          \
        acc = block_sum<T>(acc, shared);                                                                \
        if (threadIdx.x == 0) *out = acc / T(n);                                                        \
    }                                                                                                   \
    extern "C" __global__ void mse_loss_backward_##SUF(const T* a, const T* b, const T* g, i64 n, T* ga, T* gb) { \
        GRID_STRIDE(i, n) {                                                                             \
            T d = T(2) * (a[i] - b[i]) * *g / T(n);                                                     \
            if (ga) ga[i] = d;                                                                          \
            if (gb) gb[i] = -d;                                                                         \
        }                                                                                               \
    }

LOSS(float, f32)
LOSS(double, f64)

// Cross-entropy's row losses and its logits' gradient in one launch (the chunks of a language
// model's head: cross_entropy_rows and cross_entropy_backward read a chunk of GPT-2's logits five
// times, 1.4 ms a chunk of 2,560 rows on an H100). A block of 256 threads per row: each thread's
// running max and sum of exponentials over its elements in one pass (the sum rescaled when the max
// grows), merged over the block in a fixed tree; then the gradient gx[r, j] = g / n (softmax_j -
// (1 - eps) [j == t] - eps / C) in a second pass. The rows' losses go to rowloss, as
// cross_entropy_rows writes them. Each gradient element y is stored as store(y): itself, or (the
// _operands_ kernels, for the chunked head on a GPU whose products round f32) the bf16 or fp16
// operand bits the two products that alone read it would round it to, two bytes; and where `full`
// is given (the logits themselves: a head's bias gradient is summed from it), y there too, each
// element written over the logit it came from (a barrier first: thread 0 reads the target's). Where
// `predicted` is given, each row's class (the first index of its largest logit, or of its first
// NaN: max_dim's answer) goes there too, from the first pass's reading (the head's accuracy without
// a third reading of the chunk). f32 rows of a multiple of 4 values are read through Row4
// (common.cuh) and written by store4.

template <typename T, typename O, typename Store>
__device__ void cross_entropy_grad(const T* logits, const i64* target, i64 n, i64 c, T smoothing, T* rowloss, i64* bad, const T* g, O* gx,
                                   Store store, T* full, i64* predicted) {
    __shared__ T sm[256], ss[256], st[256];
    __shared__ i64 arg[256];
    const T scale = *g / T(n);
    for (i64 r = blockIdx.x; r < n; r += gridDim.x) {
        const T* row = logits + r * c;
        const i64 t = target[r];
        const bool valid = t >= 0 && t < c;
        if (!valid && threadIdx.x == 0) atomicCAS((u64*)bad, 0ULL, (u64)(r + 1));
        T m = -INFINITY, s = T(0), total = T(0);
        ArgMax<T> top_class;
        auto online = [&](i64 j, T x) {
            if (predicted) top_class.visit(j, x);
            total += x;
            if (x > m) {
                s = s * exp(m - x) + T(1);
                m = x;
            } else if (x != -INFINITY) {
                s += exp(x - m);
            }
        };
        bool wide = false;
        if constexpr (sizeof(T) == 4) {
            // (gx's row too is stored four elements at a time: 16 bytes of f32, 8 of 16-bit bits.)
            wide = Row4<T>::fits(row, c) && ((unsigned long long)(gx + r * c) & (4 * sizeof(O) - 1)) == 0;
            if (wide) Row4<T>::scan(row, c, [&](i64 j, const float4& v) {
                online(j, v.x);
                online(j + 1, v.y);
                online(j + 2, v.z);
                online(j + 3, v.w);
            });
        }
        if (!wide)
            for (i64 j = threadIdx.x; j < c; j += blockDim.x) online(j, row[j]);
        // The row's class (max_dim's answer) where asked, through sm and arg before they are reused.
        if (predicted) {
            top_class.merge(sm, arg);
            if (threadIdx.x == 0) predicted[r] = arg[0];
            __syncthreads();
        }
        sm[threadIdx.x] = m;
        ss[threadIdx.x] = s;
        st[threadIdx.x] = total;
        __syncthreads();
        for (unsigned h = blockDim.x / 2; h > 0; h >>= 1) {
            if (threadIdx.x < h) {
                const T m1 = sm[threadIdx.x], m2 = sm[threadIdx.x + h], top = fmax(m1, m2);
                const T s1 = m1 == -INFINITY ? T(0) : ss[threadIdx.x] * exp(m1 - top);
                const T s2 = m2 == -INFINITY ? T(0) : ss[threadIdx.x + h] * exp(m2 - top);
                sm[threadIdx.x] = top;
                ss[threadIdx.x] = s1 + s2;
                st[threadIdx.x] += st[threadIdx.x + h];
            }
            __syncthreads();
        }
        const T top = sm[0], sum = ss[0], lse = top + log(sum);
        if (threadIdx.x == 0)
            rowloss[r] = valid ? (T(1) - smoothing) * (lse - row[t]) + smoothing * (lse - st[0] / T(c)) : T(0);
        if (full) __syncthreads();
        auto gradient = [&](i64 j, T x) {
            return scale * (exp(x - top) / sum - (j == t ? T(1) - smoothing : T(0)) - smoothing / T(c));
        };
        if constexpr (sizeof(T) == 4) {
            if (wide) Row4<T>::scan(row, c, [&](i64 j, const float4& v) {
                const T y[4] = {gradient(j, v.x), gradient(j + 1, v.y), gradient(j + 2, v.z), gradient(j + 3, v.w)};
                const O stored[4] = {store(y[0]), store(y[1]), store(y[2]), store(y[3])};
                store4(gx + r * c, j, stored);
                if (full) store4(full + r * c, j, y);
            });
        }
        if (!wide)
            for (i64 j = threadIdx.x; j < c; j += blockDim.x) {
                const T y = gradient(j, row[j]);
                gx[r * c + j] = store(y);
                if (full) full[r * c + j] = y;
            }
        __syncthreads();
    }
}
extern "C" __global__ void cross_entropy_grad_f32(const float* logits, const i64* target, i64 n, i64 c, float smoothing, float* rowloss, i64* bad, const float* g, float* gx, i64* predicted) {
    cross_entropy_grad<float>(logits, target, n, c, smoothing, rowloss, bad, g, gx, [](float y) { return y; }, (float*)nullptr, predicted);
}
extern "C" __global__ void cross_entropy_grad_f64(const double* logits, const i64* target, i64 n, i64 c, double smoothing, double* rowloss, i64* bad, const double* g, double* gx, i64* predicted) {
    cross_entropy_grad<double>(logits, target, n, c, smoothing, rowloss, bad, g, gx, [](double y) { return y; }, (double*)nullptr, predicted);
}
extern "C" __global__ void cross_entropy_grad_operands_bf16(float* logits, const i64* target, i64 n, i64 c, float smoothing, float* rowloss, i64* bad, const float* g, unsigned short* gx, int over, i64* predicted) {
    cross_entropy_grad<float>(logits, target, n, c, smoothing, rowloss, bad, g, gx, [](float y) { return (unsigned short)operand_bits<1>(y); }, over ? logits : nullptr, predicted);
}
extern "C" __global__ void cross_entropy_grad_operands_f16(float* logits, const i64* target, i64 n, i64 c, float smoothing, float* rowloss, i64* bad, const float* g, unsigned short* gx, int over, i64* predicted) {
    cross_entropy_grad<float>(logits, target, n, c, smoothing, rowloss, bad, g, gx, [](float y) { return (unsigned short)operand_bits<2>(y); }, over ? logits : nullptr, predicted);
}
