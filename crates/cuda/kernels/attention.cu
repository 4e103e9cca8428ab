// Scaled dot-product attention, forward and backward, in three forms; all repeat bit for bit (fixed
// orders, no atomics) and need no scratch memory (O(T) memory, as the cpu path: only the per-row
// log-sum-exp is saved). Backward starts with each query row's D, rowsum(dO * O) (attention_delta_*,
// Note [Attention's D] in memfit-tensor), which the dq and dk/dv kernels read.
// - Tiled (f32, head sizes up to 128; below): a block of 128 threads takes a tile of query rows (the
//   forward, the backward's dq) or of key rows (dk and dv), stages the other side's rows in
//   shared memory a tile at a time and keeps its own results in registers, with the online softmax
//   of FlashAttention (Dao, 2022). A causal block stops at (or starts from) the diagonal.
// - Per row (f64, larger heads): one thread per query or key row walking its row in order.
// - Tensor cores (bf16 and fp16 products of f32 tensors, heads up to 128; at the end): the tiled
//   scheme with `mma.sync`, a warp per 16 rows (or 32: MEMFIT_CUDA_ATTENTION=wide), checked once
//   per device by `mma_check`.
//
// Matrix i = b * heads + h of an operand starts at offset + b * batch + h * head (elements), its
// rows `row` apart, columns contiguous (Addr); a gradient is laid out as its input. Key j is
// hidden from query r when causal and j > r, or when the mask's byte is non-zero (the mask seen
// through `mview`, its batch dims broadcast, then `mrow` and `mcol` strides). A fully hidden row
// gives a zero output and a log-sum-exp of -inf. lse is [bh, tq] contiguous.
//
// With bf16 or fp16 products (f32 only; Notes [bf16 products] and [fp16 products] in
// memfit-kernels, the cpu's split), the operands of the six products (q, k, v, the output's
// gradient, the probabilities P and the scores' gradient dS) are read rounded to bfloat16 or
// binary16 and the products add in f32; the softmax, its sums, D and the log-sum-exp stay f32.

struct Addr {
    i64 offset, batch, head, row;
};

__device__ __forceinline__ i64 matrix(const Addr& a, i64 i, i64 heads) {
    return a.offset + (i / heads) * a.batch + (i % heads) * a.head;
}

struct Visible {
    int causal;
    const unsigned char* mask;
    Strided mview;
    i64 mrow, mcol;
    __device__ bool hidden(i64 i, i64 r, i64 j) const {
        if (causal && j > r) return true;
        return mask && mask[strided_offset(mview, i) + r * mrow + j * mcol] != 0;
    }
    // As hidden, with matrix i's mask rows found once (`rows_of(i)`): the strided offset is a loop
    // of divisions, which inlined into every element of an unrolled tile made the tiled kernels'
    // code several times larger than the instruction cache.
    __device__ const unsigned char* rows_of(i64 i) const { return mask ? mask + strided_offset(mview, i) : nullptr; }
    __device__ bool hidden_in(const unsigned char* rows, i64 r, i64 j) const {
        if (causal && j > r) return true;
        return rows && rows[r * mrow + j * mcol] != 0;
    }
};

// A product's operand under rounded products, 1: bf16, 2: fp16 (f64 has none).
__device__ __forceinline__ float product_operand(float x, i64 rounding) { return rounding == 1 ? bf16_operand(x) : f16_operand(x); }
__device__ __forceinline__ double product_operand(double x, i64) { return x; }

// The operands and sizes every kernel takes.
template <typename T>
struct Problem {
    const T* q;
    const T* k;
    const T* v;
    Addr aq, ak, av;
    i64 bh, heads, tq, tk, d, dv;
    i64 rounding;  // 0: f32 products, 1: bf16, 2: fp16 (f32 only)
    T scale;
    // x as an operand of a product reads it.
    __device__ T in(T x) const { return rounding ? product_operand(x, rounding) : x; }
    __device__ const T* qrow(i64 i, i64 r) const { return q + matrix(aq, i, heads) + r * aq.row; }
    __device__ const T* krow(i64 i, i64 j) const { return k + matrix(ak, i, heads) + j * ak.row; }
    __device__ const T* vrow(i64 i, i64 j) const { return v + matrix(av, i, heads) + j * av.row; }
};

// The product of rows a and b, each element as the problem's products read it.
template <typename T>
__device__ T dot(const Problem<T>& p, const T* a, const T* b, i64 n) {
    T s = T(0);
    for (i64 c = 0; c < n; ++c) s += p.in(a[c]) * p.in(b[c]);
    return s;
}

// An element as the float it is: itself, or a saved 16-bit element (KIND's own format: 1 bf16,
// 2 f16) as the f32 that restoring it gives.
template <int KIND>
__device__ __forceinline__ float restored(float x) {
    return x;
}
template <int KIND>
__device__ __forceinline__ double restored(double x) {
    return x;
}
template <int KIND>
__device__ __forceinline__ float restored(unsigned short h) {
    return widened<KIND>(h);
}

// D = rowsum(dO * O) of every query row into delta ([bh, tq]; Note [Attention's D] in
// memfit-tensor), the output o and its gradient g both laid out by a: a warp a row, lane l adding
// the row's columns l, l + 32, ... in order, then the lanes' sums by halves (xor 16, 8, 4, 2, 1;
// each lane adds the same two values, so all agree and a run repeats bit for bit). The output is in
// T, or (O unsigned short) saved in KIND's 16 bits, each element widened as restoring it would.
template <int KIND, typename T, typename O>
__device__ void row_deltas(const O* o, const T* g, Addr a, i64 bh, i64 heads, i64 tq, i64 dv, T* delta) {
    const int lane = threadIdx.x % 32, per_block = blockDim.x / 32;
    const i64 warps = (i64)gridDim.x * per_block;
    for (i64 row = (i64)blockIdx.x * per_block + threadIdx.x / 32; row < bh * tq; row += warps) {
        const i64 at = matrix(a, row / tq, heads) + (row % tq) * a.row;
        T s = T(0);
        for (i64 c = lane; c < dv; c += 32) s += restored<KIND>(o[at + c]) * g[at + c];
        for (int m = 16; m > 0; m /= 2) s += __shfl_xor_sync(0xffffffffu, s, m);
        if (lane == 0) delta[row] = s;
    }
}

#define ATTENTION(T, SUF)                                                                               \
    extern "C" __global__ void attention_##SUF(Problem<T> p, Visible vis, T* out, Addr ao, T* lse) {    \
        GRID_STRIDE(row, p.bh * p.tq) {                                                                 \
            i64 i = row / p.tq, r = row % p.tq;                                                         \
            const T* qr = p.qrow(i, r);                                                                 \
            T* o = out + matrix(ao, i, p.heads) + r * ao.row;                                           \
            for (i64 c = 0; c < p.dv; ++c) o[c] = T(0);                                                 \
            T m = -INFINITY, l = T(0);                                                                  \
            for (i64 j = 0; j < p.tk; ++j) {                                                            \
                if (vis.hidden(i, r, j)) continue;                                                      \
                T s = p.scale * dot<T>(p, qr, p.krow(i, j), p.d);                                       \
                if (s > m) {                                                                            \
                    T alpha = exp(m - s);                                                               \
                    for (i64 c = 0; c < p.dv; ++c) o[c] *= alpha;                                       \
                    l *= alpha;                                                                         \
                    m = s;                                                                              \
                }                                                                                       \
                T e = exp(s - m);                                                                       \
                l += e;                                                                                 \
                const T* vj = p.vrow(i, j);                                                             \
                for (i64 c = 0; c < p.dv; ++c) o[c] += p.in(e) * p.in(vj[c]);                           \
            }                                                                                           \
            if (l > T(0))                                                                               \
                for (i64 c = 0; c < p.dv; ++c) o[c] /= l;                                               \
            if (lse) lse[row] = l > T(0) ? m + log(l) : -INFINITY;                                      \
        }                                                                                               \
    }                                                                                                   \
    extern "C" __global__ void attention_delta_##SUF(const T* o, const T* g, Addr a, i64 bh, i64 heads, i64 tq, i64 dv, T* delta) { \
        row_deltas<0, T>(o, g, a, bh, heads, tq, dv, delta);                                            \
    }                                                                                                   \
    /* dk and dv of every key row, each when given (delta: the rows' D, needed with dk). */             \
    extern "C" __global__ void attention_backward_kv_##SUF(Problem<T> p, Visible vis, const T* g, Addr ag, const T* lse, const T* delta, T* gk, T* gv) { \
        GRID_STRIDE(key, p.bh * p.tk) {                                                                 \
            i64 i = key / p.tk, j = key % p.tk;                                                         \
            const T* kj = p.krow(i, j);                                                                 \
            const T* vj = p.vrow(i, j);                                                                 \
            T* dk = gk ? gk + matrix(p.ak, i, p.heads) + j * p.ak.row : nullptr;                        \
            T* dvr = gv ? gv + matrix(p.av, i, p.heads) + j * p.av.row : nullptr;                       \
            if (dk) for (i64 c = 0; c < p.d; ++c) dk[c] = T(0);                                         \
            if (dvr) for (i64 c = 0; c < p.dv; ++c) dvr[c] = T(0);                                      \
            for (i64 r = 0; r < p.tq; ++r) {                                                            \
                if (vis.hidden(i, r, j)) continue;                                                      \
                const T* qr = p.qrow(i, r);                                                             \
                const T* gr = g + matrix(ag, i, p.heads) + r * ag.row;                                  \
                T prob = exp(p.scale * dot<T>(p, qr, kj, p.d) - lse[i * p.tq + r]);                     \
                if (dvr) for (i64 c = 0; c < p.dv; ++c) dvr[c] += p.in(prob) * p.in(gr[c]);             \
                if (dk) {                                                                               \
                    T ds = prob * (dot<T>(p, gr, vj, p.dv) - delta[i * p.tq + r]) * p.scale;            \
                    for (i64 c = 0; c < p.d; ++c) dk[c] += p.in(ds) * p.in(qr[c]);                      \
                }                                                                                       \
            }                                                                                           \
        }                                                                                               \
    }                                                                                                   \
    /* dq of every query row (delta: the rows' D). */                                                    \
    extern "C" __global__ void attention_backward_q_##SUF(Problem<T> p, Visible vis, const T* g, Addr ag, const T* lse, const T* delta, T* gq) { \
        GRID_STRIDE(row, p.bh * p.tq) {                                                                 \
            i64 i = row / p.tq, r = row % p.tq;                                                         \
            const T* qr = p.qrow(i, r);                                                                 \
            const T* gr = g + matrix(ag, i, p.heads) + r * ag.row;                                      \
            T* dq = gq + matrix(p.aq, i, p.heads) + r * p.aq.row;                                       \
            T dd = delta[row], l = lse[row];                                                            \
            for (i64 c = 0; c < p.d; ++c) dq[c] = T(0);                                                 \
            for (i64 j = 0; j < p.tk; ++j) {                                                            \
                if (vis.hidden(i, r, j)) continue;                                                      \
                const T* kj = p.krow(i, j);                                                             \
                T prob = exp(p.scale * dot<T>(p, qr, kj, p.d) - l);                                     \
                T ds = prob * (dot<T>(p, gr, p.vrow(i, j), p.dv) - dd) * p.scale;                       \
                for (i64 c = 0; c < p.d; ++c) dq[c] += p.in(ds) * p.in(kj[c]);                          \
            }                                                                                           \
        }                                                                                               \
    }

ATTENTION(float, f32)
ATTENTION(double, f64)

// D from an output saved in bf16 (f16) under half-precision storage, with an f32 gradient: the bits
// the restored f32 output gives, without the restored copy.
extern "C" __global__ void attention_delta_saved_bf16(const unsigned short* o, const float* g, Addr a, i64 bh, i64 heads, i64 tq, i64 dv, float* delta) {
    row_deltas<1>(o, g, a, bh, heads, tq, dv, delta);
}
extern "C" __global__ void attention_delta_saved_f16(const unsigned short* o, const float* g, Addr a, i64 bh, i64 heads, i64 tq, i64 dv, float* delta) {
    row_deltas<2>(o, g, a, bh, heads, tq, dv, delta);
}

// ----- Tiled, f32 ---------------------------------------------------------------------------------
// A block of 128 threads stages tiles in shared memory as [rows][D + 1] (the pad puts the rows of a
// tile in different banks) and multiplies them register-blocked: thread t owns the rows
// (t / TX) * TM + i (i < TM) and the columns t % TX + TX * j (j < TN) of a product's tile, so each
// step of a contraction loads TM + TN values for TM * TN multiply-adds (one value per multiply-add
// before). The TX threads that share a row merge its max and sum through shared memory in a fixed
// order, so a run repeats bit for bit. Rows past the end and columns past the head size are staged
// as zeros and never written.

#define TILE_THREADS 128
#define TX 8
#define TY (TILE_THREADS / TX)

// Rows r0 .. r0 + ROWS of a matrix (`rows` of them, `cols` values each, row r at m + r * stride)
// into `sh`, as the problem's products read them (every staged tile is a product's operand). A
// thread loads STAGE_BATCH values before it stores any: a store to shared memory between two loads
// would make each load wait for the one before (the compiler cannot tell a generic pointer from
// shared memory), one memory latency per value.
#define STAGE_BATCH 8
template <int D, int ROWS>
__device__ void stage_rows(const Problem<float>& p, float* sh, const float* m, i64 stride, i64 r0, i64 rows, i64 cols) {
    static_assert(ROWS * D % (TILE_THREADS * STAGE_BATCH) == 0, "a tile is whole batches");
    for (int e0 = threadIdx.x; e0 < ROWS * D; e0 += TILE_THREADS * STAGE_BATCH) {
        float x[STAGE_BATCH];
#pragma unroll
        for (int b = 0; b < STAGE_BATCH; ++b) {
            int e = e0 + b * TILE_THREADS, a = e / D, c = e % D;
            x[b] = (r0 + a < rows && c < cols) ? m[(r0 + a) * stride + c] : 0.0f;
        }
#pragma unroll
        for (int b = 0; b < STAGE_BATCH; ++b) {
            int e = e0 + b * TILE_THREADS;
            sh[(e / D) * (D + 1) + e % D] = p.in(x[b]);
        }
    }
}

template <int TM, int TN>
__device__ __forceinline__ void zero_tile(float (&t)[TM][TN]) {
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
        for (int j = 0; j < TN; ++j) t[i][j] = 0.0f;
}

// acc[i][j] += sum over k < K of A(m_i, k) B(k, n_j) for the thread's rows m_i = (t / TX) * TM + i
// and columns n_j = t % TX + TX * j; A(m, k) is at a[m * am + k * ak], B(k, n) at b[k * bk + n * bn],
// both in shared memory.
template <int TM, int TN, int K>
__device__ __forceinline__ void tile_product(float (&acc)[TM][TN], const float* a, int am, int ak, const float* b, int bk, int bn) {
    const int ty = threadIdx.x / TX, tx = threadIdx.x % TX;
#pragma unroll 8
    for (int k = 0; k < K; ++k) {
        float x[TM], y[TN];
#pragma unroll
        for (int i = 0; i < TM; ++i) x[i] = a[(ty * TM + i) * am + k * ak];
#pragma unroll
        for (int j = 0; j < TN; ++j) y[j] = b[k * bk + (tx + TX * j) * bn];
#pragma unroll
        for (int i = 0; i < TM; ++i)
#pragma unroll
            for (int j = 0; j < TN; ++j) acc[i][j] += x[i] * y[j];
    }
}

// v[i], the thread's partial of row (t / TX) * TM + i, becomes the max (or the sum) of the row's TX
// partials, taken in the order t % TX = 0, 1, ... through `red` ([TY * TM][TX]), the same value in
// every thread of the row. Both ends are barriers.
template <int TM, bool MAX>
__device__ __forceinline__ void merge_rows(float (&v)[TM], float* red) {
    const int ty = threadIdx.x / TX, tx = threadIdx.x % TX;
#pragma unroll
    for (int i = 0; i < TM; ++i) red[(ty * TM + i) * TX + tx] = v[i];
    __syncthreads();
#pragma unroll
    for (int i = 0; i < TM; ++i) {
        const float* row = red + (ty * TM + i) * TX;
        float r = row[0];
        for (int t = 1; t < TX; ++t) r = MAX ? fmaxf(r, row[t]) : r + row[t];
        v[i] = r;
    }
    __syncthreads();
}

// The forward of one tile of BR query rows: out and lse of rows r0 .. r0 + BR of matrix i, key
// tiles of BC rows at a time, with the online softmax.
template <int D, int BR, int BC>
__device__ void attention_tile(const Problem<float>& p, const Visible& vis, float* out, const Addr& ao, float* lse, i64 i, i64 r0) {
    constexpr int TM = BR / TY, TN = BC / TX, TO = D / TX;
    __shared__ float qs[BR * (D + 1)], ks[BC * (D + 1)], vs[BC * (D + 1)], ps[BR * (BC + 1)], red[BR * TX];
    const int ty = threadIdx.x / TX, tx = threadIdx.x % TX;
    const unsigned char* masked = vis.rows_of(i);
    float o[TM][TO], m[TM], l[TM];
    zero_tile(o);
#pragma unroll
    for (int a = 0; a < TM; ++a) { m[a] = -INFINITY; l[a] = 0.0f; }
    stage_rows<D, BR>(p, qs, p.q + matrix(p.aq, i, p.heads), p.aq.row, r0, p.tq, p.d);
    i64 kend = vis.causal ? min(p.tk, r0 + BR) : p.tk;
    for (i64 j0 = 0; j0 < kend; j0 += BC) {
        __syncthreads();
        stage_rows<D, BC>(p, ks, p.k + matrix(p.ak, i, p.heads), p.ak.row, j0, p.tk, p.d);
        stage_rows<D, BC>(p, vs, p.v + matrix(p.av, i, p.heads), p.av.row, j0, p.tk, p.dv);
        __syncthreads();
        float s[TM][TN], top[TM], sum[TM];
        zero_tile(s);
        tile_product<TM, TN, D>(s, qs, D + 1, 1, ks, 1, D + 1);
#pragma unroll
        for (int a = 0; a < TM; ++a) {
            i64 r = r0 + ty * TM + a;
            top[a] = -INFINITY;
#pragma unroll
            for (int b = 0; b < TN; ++b) {
                i64 j = j0 + tx + TX * b;
                bool seen = r < p.tq && j < p.tk && !vis.hidden_in(masked, r, j);
                s[a][b] = seen ? p.scale * s[a][b] : -INFINITY;
                top[a] = fmaxf(top[a], s[a][b]);
            }
        }
        merge_rows<TM, true>(top, red);
#pragma unroll
        for (int a = 0; a < TM; ++a) {
            float mnew = fmaxf(m[a], top[a]), alpha = 1.0f;
            sum[a] = 0.0f;
            if (mnew != -INFINITY) {
                alpha = expf(m[a] - mnew);
#pragma unroll
                for (int b = 0; b < TN; ++b) { s[a][b] = expf(s[a][b] - mnew); sum[a] += s[a][b]; }
                m[a] = mnew;
            } else {
#pragma unroll
                for (int b = 0; b < TN; ++b) s[a][b] = 0.0f;
            }
            l[a] *= alpha;
#pragma unroll
            for (int c = 0; c < TO; ++c) o[a][c] *= alpha;
#pragma unroll
            for (int b = 0; b < TN; ++b) ps[(ty * TM + a) * (BC + 1) + tx + TX * b] = p.in(s[a][b]);
        }
        merge_rows<TM, false>(sum, red);
#pragma unroll
        for (int a = 0; a < TM; ++a) l[a] += sum[a];
        tile_product<TM, TO, BC>(o, ps, BC + 1, 1, vs, D + 1, 1);
    }
#pragma unroll
    for (int a = 0; a < TM; ++a) {
        i64 r = r0 + ty * TM + a;
        if (r >= p.tq) continue;
        float* row = out + matrix(ao, i, p.heads) + r * ao.row;
#pragma unroll
        for (int c = 0; c < TO; ++c) {
            int col = tx + TX * c;
            if (col < p.dv) row[col] = l[a] > 0.0f ? o[a][c] / l[a] : 0.0f;
        }
        if (lse && tx == 0) lse[i * p.tq + r] = l[a] > 0.0f ? m[a] + logf(l[a]) : -INFINITY;
    }
    __syncthreads();
}

// dq of one tile of BR query rows, key tiles of BC rows at a time (delta: the rows' D).
template <int D, int BR, int BC>
__device__ void attention_backward_q_tile(const Problem<float>& p, const Visible& vis, const float* g, const Addr& ag, const float* lse,
                                          const float* delta, float* gq, i64 i, i64 r0) {
    constexpr int TM = BR / TY, TN = BC / TX, TO = D / TX;
    __shared__ float qs[BR * (D + 1)], gs[BR * (D + 1)], ks[BC * (D + 1)], vs[BC * (D + 1)], dss[BR * (BC + 1)];
    const int ty = threadIdx.x / TX, tx = threadIdx.x % TX;
    const unsigned char* masked = vis.rows_of(i);
    float acc[TM][TO], lr[TM], dr[TM];
    zero_tile(acc);
    float* gq0 = gq + matrix(p.aq, i, p.heads);
    stage_rows<D, BR>(p, qs, p.q + matrix(p.aq, i, p.heads), p.aq.row, r0, p.tq, p.d);
    stage_rows<D, BR>(p, gs, g + matrix(ag, i, p.heads), ag.row, r0, p.tq, p.dv);
#pragma unroll
    for (int a = 0; a < TM; ++a) {
        i64 r = r0 + ty * TM + a;
        lr[a] = r < p.tq ? lse[i * p.tq + r] : 0.0f;
        dr[a] = r < p.tq ? delta[i * p.tq + r] : 0.0f;
    }
    i64 kend = vis.causal ? min(p.tk, r0 + BR) : p.tk;
    for (i64 j0 = 0; j0 < kend; j0 += BC) {
        __syncthreads();
        stage_rows<D, BC>(p, ks, p.k + matrix(p.ak, i, p.heads), p.ak.row, j0, p.tk, p.d);
        stage_rows<D, BC>(p, vs, p.v + matrix(p.av, i, p.heads), p.av.row, j0, p.tk, p.dv);
        __syncthreads();
        float s[TM][TN], dp[TM][TN];
        zero_tile(s);
        zero_tile(dp);
        tile_product<TM, TN, D>(s, qs, D + 1, 1, ks, 1, D + 1);
        tile_product<TM, TN, D>(dp, gs, D + 1, 1, vs, 1, D + 1);
#pragma unroll
        for (int a = 0; a < TM; ++a) {
            i64 r = r0 + ty * TM + a;
#pragma unroll
            for (int b = 0; b < TN; ++b) {
                i64 j = j0 + tx + TX * b;
                bool seen = r < p.tq && j < p.tk && !vis.hidden_in(masked, r, j);
                float prob = seen ? expf(p.scale * s[a][b] - lr[a]) : 0.0f;
                dss[(ty * TM + a) * (BC + 1) + tx + TX * b] = p.in(prob * (dp[a][b] - dr[a]) * p.scale);
            }
        }
        __syncthreads();
        tile_product<TM, TO, BC>(acc, dss, BC + 1, 1, ks, D + 1, 1);
    }
#pragma unroll
    for (int a = 0; a < TM; ++a) {
        i64 r = r0 + ty * TM + a;
        if (r >= p.tq) continue;
#pragma unroll
        for (int c = 0; c < TO; ++c) {
            int col = tx + TX * c;
            if (col < p.d) gq0[r * p.aq.row + col] = acc[a][c];
        }
    }
    __syncthreads();
}

// dk and dv of one tile of KC key rows, from every query row that sees them, KR query rows at a
// time (delta: the rows' D).
template <int D, int KR, int KC>
__device__ void attention_backward_kv_tile(const Problem<float>& p, const Visible& vis, const float* g, const Addr& ag, const float* lse,
                                           const float* delta, float* gk, float* gv, i64 i, i64 j0) {
    constexpr int TM = KR / TY, TN = KC / TX, UM = KC / TY, TO = D / TX;
    __shared__ float ks[KC * (D + 1)], vs[KC * (D + 1)], qs[KR * (D + 1)], gs[KR * (D + 1)];
    __shared__ float ps[KR * (KC + 1)], dss[KR * (KC + 1)], l_row[KR], d_row[KR];
    const int ty = threadIdx.x / TX, tx = threadIdx.x % TX;
    const unsigned char* masked = vis.rows_of(i);
    float dk[UM][TO], dv[UM][TO];
    zero_tile(dk);
    zero_tile(dv);
    stage_rows<D, KC>(p, ks, p.k + matrix(p.ak, i, p.heads), p.ak.row, j0, p.tk, p.d);
    stage_rows<D, KC>(p, vs, p.v + matrix(p.av, i, p.heads), p.av.row, j0, p.tk, p.dv);
    i64 rstart = vis.causal ? (j0 / KR) * KR : 0;
    for (i64 r0 = rstart; r0 < p.tq; r0 += KR) {
        __syncthreads();
        stage_rows<D, KR>(p, qs, p.q + matrix(p.aq, i, p.heads), p.aq.row, r0, p.tq, p.d);
        stage_rows<D, KR>(p, gs, g + matrix(ag, i, p.heads), ag.row, r0, p.tq, p.dv);
        if (threadIdx.x < KR) {
            i64 r = r0 + threadIdx.x;
            l_row[threadIdx.x] = r < p.tq ? lse[i * p.tq + r] : 0.0f;
            d_row[threadIdx.x] = r < p.tq ? delta[i * p.tq + r] : 0.0f;
        }
        __syncthreads();
        float s[TM][TN], dp[TM][TN];
        zero_tile(s);
        zero_tile(dp);
        tile_product<TM, TN, D>(s, qs, D + 1, 1, ks, 1, D + 1);
        tile_product<TM, TN, D>(dp, gs, D + 1, 1, vs, 1, D + 1);
#pragma unroll
        for (int a = 0; a < TM; ++a) {
            int row = ty * TM + a;
            i64 r = r0 + row;
#pragma unroll
            for (int b = 0; b < TN; ++b) {
                int col = tx + TX * b;
                i64 j = j0 + col;
                bool seen = r < p.tq && j < p.tk && !vis.hidden_in(masked, r, j);
                float prob = seen ? expf(p.scale * s[a][b] - l_row[row]) : 0.0f;
                ps[row * (KC + 1) + col] = p.in(prob);
                dss[row * (KC + 1) + col] = seen ? p.in(prob * (dp[a][b] - d_row[row]) * p.scale) : 0.0f;
            }
        }
        __syncthreads();
        // dv += P^T dO and dk += dS^T Q: A(key b, query a) is ps[a * (KC + 1) + b].
        tile_product<UM, TO, KR>(dv, ps, 1, KC + 1, gs, D + 1, 1);
        tile_product<UM, TO, KR>(dk, dss, 1, KC + 1, qs, D + 1, 1);
    }
    // Matrix i's gradients found once (`matrix` divides), not at every store of the unrolled loop.
    float *gk0 = gk ? gk + matrix(p.ak, i, p.heads) : nullptr, *gv0 = gv ? gv + matrix(p.av, i, p.heads) : nullptr;
#pragma unroll
    for (int a = 0; a < UM; ++a) {
        i64 j = j0 + ty * UM + a;
        if (j >= p.tk) continue;
#pragma unroll
        for (int c = 0; c < TO; ++c) {
            int col = tx + TX * c;
            if (gk0 && col < p.d) gk0[j * p.ak.row + col] = dk[a][c];
            if (gv0 && col < p.dv) gv0[j * p.av.row + col] = dv[a][c];
        }
    }
    __syncthreads();
}

// The tile of launch task t (tiles of `tiles` rows' worth each, matrix t / tiles): the tiles of a
// matrix in order, or, where later tiles see more of the other side (query tiles under a causal
// mask, LATE), the heaviest first. Blocks start in the order of their index, so the work that
// comes last is the lightest and the GPU's multiprocessors finish together.
__device__ __forceinline__ i64 task_tile(i64 t, i64 tiles, bool late) {
    i64 k = t % tiles;
    return late ? tiles - 1 - k : k;
}

// The entry points for head sizes up to D: blocks walk the (matrix, tile) pairs in task_tile's
// order, so a block's threads always agree on their tile (the barriers inside need that). The
// forward's query tiles of FR rows meet key tiles of FC rows; dq's query tiles of QR rows
// meet key tiles of QC; dk and dv's key tiles of KC rows meet query tiles of KR. Row counts are
// multiples of TY, column counts of TX; each tile set fits the 48 KiB of static shared memory.
#define ATTENTION_TILED(D, FR, FC, QR, QC, KC, KR)                                                      \
    extern "C" __global__ void attention_tiled_d##D##_f32(Problem<float> p, Visible vis, float* out, Addr ao, float* lse) { \
        i64 tiles = (p.tq + FR - 1) / FR;                                                               \
        for (i64 t = blockIdx.x; t < p.bh * tiles; t += gridDim.x)                                      \
            attention_tile<D, FR, FC>(p, vis, out, ao, lse, t / tiles, task_tile(t, tiles, vis.causal) * FR); \
    }                                                                                                   \
    extern "C" __global__ void attention_tiled_backward_q_d##D##_f32(Problem<float> p, Visible vis, const float* g, Addr ag, const float* lse, const float* delta, float* gq) { \
        i64 tiles = (p.tq + QR - 1) / QR;                                                               \
        for (i64 t = blockIdx.x; t < p.bh * tiles; t += gridDim.x)                                      \
            attention_backward_q_tile<D, QR, QC>(p, vis, g, ag, lse, delta, gq, t / tiles, task_tile(t, tiles, vis.causal) * QR); \
    }                                                                                                   \
    extern "C" __global__ void attention_tiled_backward_kv_d##D##_f32(Problem<float> p, Visible vis, const float* g, Addr ag, const float* lse, const float* delta, float* gk, float* gv) { \
        i64 tiles = (p.tk + KC - 1) / KC;                                                               \
        for (i64 t = blockIdx.x; t < p.bh * tiles; t += gridDim.x)                                      \
            attention_backward_kv_tile<D, KR, KC>(p, vis, g, ag, lse, delta, gk, gv, t / tiles, task_tile(t, tiles, false) * KC); \
    }

ATTENTION_TILED(64, 64, 32, 32, 32, 32, 32)
ATTENTION_TILED(128, 32, 16, 16, 16, 16, 16)

// ----- Tensor cores: bf16 and fp16 products -------------------------------------------------------
// With rounded products (rounding 1: bf16, 2: fp16; the kernels' KIND) and head sizes up to 128, the
// six products run on the tensor cores (`mma_16816`, f32 accumulation), in FlashAttention-2's
// scheme (Dao, 2023): a block of MMA_WARPS warps takes 16 M MMA_WARPS rows (query rows for the
// forward and dq; key rows for dk and dv), each warp M tiles of 16 of them (M: 1, or 2 in the
// `mma_wide` kernels), its own side's operands in registers, and
// walks the other side's tiles, staged in shared memory by rows (words that each hold a pair of a
// row's elements), 16 bytes a copy without waiting (`cp.async`), into two buffers: the next tile's
// copies run while this tile's products do. The products read a tile's B fragments with `ldmatrix`:
// as it is, where the tile's rows are the product's n (K in Q K^T, V in dO V^T), transposed where
// they are its k (V in P V, K in dS K, Q and the output's gradient in dS^T Q and P^T dO). A row's
// max and sum are taken over its quad of lanes with two shuffles, the same value in
// all four, so a run repeats bit for bit (no atomics). What they compute is the tiled kernels'
// (above), in another order of f32 additions: P is rounded before it is normalized.
//
// The operands q, k, v (and the output's gradient) are rounded once a launch, by attention_round_*,
// into 16-bit copies in the op's workspace (`attention_bits` in memfit-tensor): matrix i's row r at
// (i * rows + r) * dp, dp the head size rounded up to 8 (zeros past it), so the kernels read
// operand bits 16 bytes at a time and convert nothing they stage. (Rounding in every block's
// staging instead, each key tile rounded again by every query tile, made the kernels' instructions
// their limit on an H100: 5 ms for GPT-2's forward, 9 for dk and dv.)

#define MMA_WARPS 4

// The exponentials of the kernels below, as FlashAttention takes them: e^x as 2^(x log2 e), with
// log2 e folded into the scores' scale (LOG2E; a log-sum-exp read is multiplied by it, one written
// comes back by LN2), and 2^y by the multi-function unit (`ex2.approx.ftz.f32`: within 2 units in
// the last place, a subnormal result flushed to zero, 2^-inf = 0): two instructions an element where
// expf takes about eight. Their results are a few units in the last place from expf's, far below
// the rounding that P and dS meet before their products.
#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f
__device__ __forceinline__ float exp2_fast(float y) {
#ifdef MEMFIT_EMULATOR
    const float r = exp2f(y);
    return r < 1.17549435e-38f ? 0.0f : r;
#else
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(y));
    return r;
#endif
}

// The rounded copies of a launch's operands (the output's gradient: backward only), and each one's
// layout (elements, as Addr's): a copy in the op's workspace, [bh, rows, dp] (matrix i at
// i * rows * dp, its rows dp apart); or q, k and v read in place (forward and backward) as saved in the
// products' own 16 bits (Note [Attention's saved operands] in memfit-tensor: their own layout, every
// row 16-byte aligned and d a multiple of 8, so dp = d).
struct Bits {
    const unsigned short *q, *k, *v, *g;
    Addr aq, ak, av, ag;
    // Matrix i of each.
    __device__ const unsigned short* q_of(i64 i, i64 heads) const { return q + matrix(aq, i, heads); }
    __device__ const unsigned short* k_of(i64 i, i64 heads) const { return k + matrix(ak, i, heads); }
    __device__ const unsigned short* v_of(i64 i, i64 heads) const { return v + matrix(av, i, heads); }
    __device__ const unsigned short* g_of(i64 i, i64 heads) const { return g + matrix(ag, i, heads); }
};

// A head size rounded up to a multiple of 8 (16 bytes of 16-bit elements): a row of a rounded copy.
__device__ __forceinline__ i64 padded8(i64 d) { return (d + 7) & ~(i64)7; }

// Four elements of In from p (16 bytes of f32, 8 of 16-bit ones) as the floats they are.
__device__ __forceinline__ float4 load4(const float* p) { return *(const float4*)p; }
template <int KIND>
__device__ __forceinline__ float4 load4(const unsigned short* p) {
    return widened4<KIND>(p);
}
template <int KIND>
__device__ __forceinline__ float4 load4(const float* p) { return load4(p); }

// Operand x (laid out by a) as KIND's bits into y, [bh, rows, padded8(d)]. Where every row starts
// 16 bytes aligned and d is a multiple of 4 (a GPT's q, k and v, in place in the packed projection
// or saved): a thread a group of four elements (one load, one 8-byte store), two groups' loads in
// flight (a warp a row, its lanes along the row's pairs, ran at 1.3-1.9 TB/s on the H200: too few
// bytes in flight). Else a warp a row, its lanes along the row's pairs. The same bits either way.
template <int KIND, typename In>
__device__ void round_rows(const In* x, Addr a, i64 bh, i64 heads, i64 rows, i64 d, unsigned short* y) {
    const i64 dp = padded8(d);
    const i64 in_bytes = sizeof(In);
    const bool wide = d % 4 == 0 && ((u64)x % 16) == 0 && (a.offset * in_bytes) % 16 == 0 && (a.batch * in_bytes) % 16 == 0 &&
                      (a.head * in_bytes) % 16 == 0 && (a.row * in_bytes) % 16 == 0;
    if (wide) {
        // Group g: row g / per of the [bh, rows] rows, its elements 4 (g % per) ..; per = dp / 4
        // groups a row, those past d zeros.
        const i64 per = dp / 4, groups = bh * rows * per;
        const auto from = [&](i64 g) {
            const i64 row = g / per, c = 4 * (g - row * per), i = row / rows;
            return c < d ? load4<KIND>(x + matrix(a, i, heads) + (row - i * rows) * a.row + c) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        };
        const auto to = [&](i64 g, float4 v) {
            *(uint2*)(y + 4 * g) = make_uint2(operand_pair_fast<KIND>(v.x, v.y), operand_pair_fast<KIND>(v.z, v.w));
        };
        grid_two_in_flight(groups, from, to);
        return;
    }
    const int warps = blockDim.x / 32, lane = threadIdx.x % 32;
    for (i64 row = (i64)blockIdx.x * warps + threadIdx.x / 32; row < bh * rows; row += (i64)gridDim.x * warps) {
        const i64 i = row / rows, r = row - i * rows;
        const In* from = x + matrix(a, i, heads) + r * a.row;
        unsigned* to = (unsigned*)(y + row * dp);
        for (i64 c = 2 * lane; c < dp; c += 64) {
            const float lo = c < d ? restored<KIND>(from[c]) : 0.0f, hi = c + 1 < d ? restored<KIND>(from[c + 1]) : 0.0f;
            to[c / 2] = operand_pair_fast<KIND>(lo, hi);
        }
    }
}
extern "C" __global__ void attention_round_bf16(const float* x, Addr a, i64 bh, i64 heads, i64 rows, i64 d, unsigned short* y) {
    round_rows<1>(x, a, bh, heads, rows, d, y);
}
extern "C" __global__ void attention_round_f16(const float* x, Addr a, i64 bh, i64 heads, i64 rows, i64 d, unsigned short* y) {
    round_rows<2>(x, a, bh, heads, rows, d, y);
}
// The same from operands saved in the products' own 16-bit format (backward's q, k and v under
// half-precision storage): the bits the f32 restored from them would round to.
extern "C" __global__ void attention_round_saved_bf16(const unsigned short* x, Addr a, i64 bh, i64 heads, i64 rows, i64 d, unsigned short* y) {
    round_rows<1>(x, a, bh, heads, rows, d, y);
}
extern "C" __global__ void attention_round_saved_f16(const unsigned short* x, Addr a, i64 bh, i64 heads, i64 rows, i64 d, unsigned short* y) {
    round_rows<2>(x, a, bh, heads, rows, d, y);
}

// Rows r0 .. r0 + R of a rounded matrix m (`rows` of them, dp elements each, ld apart) into shared
// memory by rows: row a's pair c / 2 at sh[a * LD + c / 2], C columns (zeros past dp and past the
// matrix), 16 bytes a copy, without waiting (cp_async: the caller commits and waits). Every tile is
// staged so; a product that needs it by columns reads it through ldmatrix's transpose. TPR threads
// share a row: at copy b, thread j of them takes chunk b TPR + j of 16 bytes, so a thread's copies
// of a tile are one address and constant offsets (in global memory as in shared), and a warp's copy
// reads TPR chunks side by side of each of its rows (whole 32-byte sectors where rows start 32-byte
// aligned, as GPT-2's heads of 64 do). A group of 8 threads (the 128 bytes shared memory stores at
// once) takes rows TPR apart, whose chunks then fall in 8 different groups of 4 banks (LD is 4 more
// than a multiple of 32 words): no conflict. The tiles are staged in order, R rows apart, so a
// thread's address moves on by R rows a tile (`Copies`, made before the loop over tiles). Where the
// tile lies inside the matrix and its rows are C columns (every tile but a last partial one of a
// GPT's heads of 64), a thread's copies are its N instructions and the address's step; else each
// copy is tested. (Found again at every tile with 64-bit products, each copy tested, the addresses
// made staging a fifth to a third of the kernels' loops in instructions.) A copy past the matrix
// reads nothing (a source size of 0 bytes) and is given the matrix's first address, not one past
// its end: the PTX ISA does not say that an address it reads nothing from may be any address.
template <int R, int C, int LD>
struct Copies {
    static constexpr int CHUNKS = C / 8, N = R * CHUNKS / TILE_THREADS, TPR = CHUNKS / N;
    static_assert(R * CHUNKS % TILE_THREADS == 0, "a tile is whole chunks for every thread");
    static_assert(N > 0 && CHUNKS % N == 0 && 8 % TPR == 0 && R % 8 == 0, "a group of 8 threads takes whole rows");
    static_assert(LD % 32 == 4, "rows TPR apart fall in different banks");
    // The matrix, and the thread's first copy of the next tile in it (moved on R rows a tile).
    const unsigned short *base, *next;
    // The elements from one tile's first copy to the next's (R rows on).
    i64 advance;
    // The thread's row of a tile, its first chunk, its first copy's place in shared memory (words),
    // and the chunks of a row that hold columns (dp / 8).
    int row, chunk, at, chunks_inside;
    // Matrix m's rows ld apart, dp elements each; the first tile staged is rows r0 .. r0 + R.
    __device__ Copies(const unsigned short* m, i64 ld, i64 dp, i64 r0)
        : base(m), next(m + (r0 + row_of()) * ld + 8 * chunk_of()), advance(R * ld), row(row_of()), chunk(chunk_of()),
          at(row_of() * LD + 4 * chunk_of()), chunks_inside((int)(dp / 8)) {}
    // Thread t's row: its group of 8 (g = t / 8) takes rows 8 (g / TPR) + g % TPR + TPR i, i < 8 / TPR.
    __device__ static int row_of() {
        const int t = (int)threadIdx.x, g = t / 8;
        return 8 * (g / TPR) + g % TPR + TPR * ((t % 8) / TPR);
    }
    __device__ static int chunk_of() { return (int)threadIdx.x % TPR; }
    // The next tile, rows r0 .. r0 + R (of `rows`), into sh: the tiles in order, R rows apart.
    __device__ __forceinline__ void stage(unsigned* sh, i64 r0, i64 rows) {
        if (chunks_inside == CHUNKS && r0 + R <= rows) {
#pragma unroll
            for (int b = 0; b < N; ++b) cp_async<16>(sh + at + 4 * TPR * b, next + 8 * TPR * b, true);
        } else {
            const bool row_inside = row < rows - r0;
#pragma unroll
            for (int b = 0; b < N; ++b) {
                const bool inside = row_inside && chunk + TPR * b < chunks_inside;
                cp_async<16>(sh + at + 4 * TPR * b, inside ? next + 8 * TPR * b : base, inside);
            }
        }
        next += advance;
    }
};

// Key tile j0's rows of K and V (their rounded copies k0 and v0) into buffers ks and vs, as one
// group of copies that nobody waits for yet (the forward's and dq's tiles).
template <int BC, int D>
struct KeyCopies {
    Copies<BC, D, D / 2 + 4> k, v;
    __device__ KeyCopies(const unsigned short* k0, i64 kld, const unsigned short* v0, i64 vld, i64 dp, i64 dvp) : k(k0, kld, dp, 0), v(v0, vld, dvp, 0) {}
    __device__ __forceinline__ void stage(unsigned* ks, unsigned* vs, i64 j0, i64 tk) {
        k.stage(ks, j0, tk);
        v.stage(vs, j0, tk);
        cp_async_commit();
    }
};

// The pipeline's step, one barrier a tile: this tile's copies (the only ones in flight) are waited
// for; after the barrier every thread's copies are visible, and every warp is done with the tile
// before, so the next tile's copies (`more`: `stage_next`) start into its buffer, running while
// this tile's products do.
template <typename Stage>
__device__ __forceinline__ void tile_arrives(bool more, Stage stage_next) {
    cp_async_wait<0>();
    __syncthreads();
    if (more) stage_next();
}

// The A fragment of rows r0 .. r0 + 16 and columns k0 .. k0 + 16 of a rounded matrix m (`rows` of
// them, dp elements each, ld apart; zeros past both).
__device__ __forceinline__ void load_a(unsigned (&a)[4], const unsigned short* m, i64 ld, i64 dp, i64 r0, i64 rows, int k0) {
    const int g = (threadIdx.x % 32) / 4, t = threadIdx.x % 4;
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        const i64 r = r0 + g + 8 * (q & 1);
        const int c = k0 + 2 * t + 8 * (q >> 1);
        a[q] = (r < rows && c < dp) ? *(const unsigned*)(m + r * ld + c) : 0u;
    }
}

// operand_pair_fast's bits, for values that are all zeros or normal floats when NORMAL (the
// probabilities P, exp2_fast's results, whose subnormals are flushed): bfloat16 has f32's
// exponents, so such a value rounds to a zero or a normal bfloat16 (or infinity), which the flush
// to a zero of its sign keeps as it is. One conversion a pair, where the flush took four more
// logic instructions. (The emulator runs operand_pair_fast's definition either way: only a GPU's
// parity run exercises this conversion.)
template <int KIND, bool NORMAL>
__device__ __forceinline__ unsigned normal_pair(float lo, float hi) {
#ifndef MEMFIT_EMULATOR
    if (NORMAL && KIND == 1) {
        unsigned r;
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
        return r;
    }
#endif
    return operand_pair_fast<KIND>(lo, hi);
}

// The A fragment of columns 16 kk .. 16 kk + 16 of a 16-row accumulator s (its n-tiles 2 kk and
// 2 kk + 1), as operand bits: the accumulator's layout is the A fragment's, two tiles wide.
template <int KIND, bool NORMAL, int N>
__device__ __forceinline__ void accumulator_a(unsigned (&a)[4], const float (&s)[N][4], int kk) {
    a[0] = normal_pair<KIND, NORMAL>(s[2 * kk][0], s[2 * kk][1]);
    a[1] = normal_pair<KIND, NORMAL>(s[2 * kk][2], s[2 * kk][3]);
    a[2] = normal_pair<KIND, NORMAL>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
    a[3] = normal_pair<KIND, NORMAL>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
}

template <int N>
__device__ __forceinline__ void zero_acc(float (&s)[N][4]) {
#pragma unroll
    for (int n = 0; n < N; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[n][e] = 0.0f;
}

// s = A B for each of a warp's M tiles of 16 rows: A (tile m's a[m]) by KD chunks of 16 columns in
// fragments; B(k, n) = tile[n][k] of a staged tile, NS n-tiles (its rows). One ldmatrix gives the
// B fragments of two chunks of k, for all M tiles of rows (with M = 2 a warp reads each of B's
// fragments from shared memory for twice the products). Each accumulator adds its chunks of k in
// order, whatever M.
template <int KIND, int M, int NS, int KD>
__device__ __forceinline__ void product(float (&s)[M][NS][4], const unsigned (&a)[M][KD][4], const unsigned* sh, int ld) {
    static_assert(KD % 2 == 0, "chunks of k in pairs");
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int mt = 0; mt < M; ++mt) zero_acc(s[mt]);
#pragma unroll
    for (int n = 0; n < NS; ++n)
#pragma unroll
        for (int kk = 0; kk < KD; kk += 2) {
            // Matrix m: rows 8 n .. 8 n + 8, columns 16 kk + 8 m .. + 8.
            unsigned b[4];
            ldmatrix_x4<false>(b, sh + (8 * n + lane % 8) * ld + (16 * kk + 8 * (lane / 8)) / 2);
            const unsigned b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
#pragma unroll
            for (int mt = 0; mt < M; ++mt) {
                mma_16816<KIND>(s[mt][n], a[mt][kk], b0);
                mma_16816<KIND>(s[mt][n], a[mt][kk + 1], b1);
            }
        }
}

// acc += S B for each of a warp's M tiles of 16 rows: S (tile m's s[m]) an accumulator of 16 rows
// by 8 NS columns, read as operands; B(k, n) = tile[k][n] of a staged tile (its rows are S's
// columns), NO n-tiles. One transposing ldmatrix gives the B fragments of two n-tiles, for all M
// tiles of rows. NORMAL: S holds zeros and normal floats only (normal_pair).
template <int KIND, bool NORMAL, int M, int NS, int NO>
__device__ __forceinline__ void accumulate(float (&acc)[M][NO][4], const float (&s)[M][NS][4], const unsigned* sh, int ld) {
    static_assert(NO % 2 == 0, "n-tiles in pairs");
    const int lane = threadIdx.x % 32, m = lane / 8;
#pragma unroll
    for (int kk = 0; kk < NS / 2; ++kk) {
        unsigned a[M][4];
#pragma unroll
        for (int mt = 0; mt < M; ++mt) accumulator_a<KIND, NORMAL>(a[mt], s[mt], kk);
#pragma unroll
        for (int c = 0; c < NO; c += 2) {
            // Matrix m: rows 16 kk + 8 (m & 1) .. + 8, columns 8 (c + (m >> 1)) .. + 8.
            unsigned b[4];
            ldmatrix_x4<true>(b, sh + (16 * kk + 8 * (m & 1) + lane % 8) * ld + 4 * (c + (m >> 1)));
            const unsigned b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
#pragma unroll
            for (int mt = 0; mt < M; ++mt) {
                mma_16816<KIND>(acc[mt][c], a[mt], b0);
                mma_16816<KIND>(acc[mt][c + 1], a[mt], b1);
            }
        }
    }
}
// v becomes the max (or the sum) of the four lanes of its quad, the same in all four.
template <bool MAX>
__device__ __forceinline__ float quad(float v) {
    for (int m = 1; m <= 2; m *= 2) {
        float o = __shfl_xor_sync(0xffffffffu, v, m);
        v = MAX ? fmaxf(v, o) : v + o;
    }
    return v;
}

// Whether each of the 16 query rows from rw sees every key of the `width` from j0 before any mask:
// the keys inside the matrix and, under a causal mask, the tile's last key at or before the first
// row. (A row past the queries may see anything: it is never written, and nothing it holds reaches
// another row: a product's row is its first operand's row's, and the quads' shuffles, the running
// max and the sum are a row's own.) The same for the warp's 32 lanes, so the element loop it picks
// does not diverge.
__device__ __forceinline__ bool all_seen(const Problem<float>& p, const Visible& vis, i64 rw, i64 j0, int width) {
    return j0 + width <= p.tk && (!vis.causal || j0 + width - 1 <= rw);
}

// The keys of a key tile from j0 that query row r sees before any mask, j0 + c for c < the limit:
// none past the queries, none past the keys, and under a causal mask none past r. Computed once a
// row and a tile, so an element's test is one compare (and the mask's byte, where there is one).
__device__ __forceinline__ int keys_seen(const Problem<float>& p, const Visible& vis, i64 r, i64 j0, int width) {
    if (r >= p.tq) return 0;
    i64 limit = min((i64)width, p.tk - j0);
    if (vis.causal) limit = min(limit, r - j0 + 1);
    return (int)max(limit, (i64)0);
}

// The element loops of the three kernels below, each instantiated for three tests (TEST): none,
// where a warp's rows see every key of the tile (no mask, and the tile inside both sides and below
// a causal diagonal: most tiles of a long causal sequence); the limits; the limits and the mask's
// byte. So a maskless launch (a GPT's causal attention) tests no mask byte an element (that test, a
// branch an element, was 150 of the forward's 4,100 instructions, with its branches' convergence
// points), and its inner tiles test nothing (the limits' compares and selects were 100 of the
// forward's 750 instructions a tile). Thread t of a quad holds columns 8 n + 2 t + {0, 1} of its
// rows `row` and `row + 8`.
#define ALL_SEEN 0
#define LIMITS 1
#define LIMITS_AND_MASK 2

// The forward's scores of a key tile from j0, scaled, -inf where unseen (past limit, or masked), and
// each of the two rows' max so far into top.
template <int TEST, int NS>
__device__ __forceinline__ void seen_scores(float (&s)[NS][4], float (&top)[2], const int (&limit)[2], const unsigned char* masked,
                                            const Visible& vis, i64 row, i64 j0, float scale) {
    const int t = threadIdx.x % 4;
#pragma unroll
    for (int n = 0; n < NS; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int c = 8 * n + 2 * t + (e & 1);
            const bool seen =
                TEST == ALL_SEEN || (c < limit[e >> 1] && !(TEST == LIMITS_AND_MASK && masked[(row + 8 * (e >> 1)) * vis.mrow + (j0 + c) * vis.mcol]));
            s[n][e] = seen ? scale * s[n][e] : -INFINITY;
            top[e >> 1] = fmaxf(top[e >> 1], s[n][e]);
        }
}

// dq's tile: s, the scores, becomes dS, from the probabilities P (from s and the rows' log-sum-exp
// lr, both in base 2: scale2 is the scale times LOG2E, lr the log-sum-exp times LOG2E; 2^-inf = 0
// where unseen: a select, not a branch), dP and the rows' D (dr).
template <int TEST, int NS>
__device__ __forceinline__ void query_gradients(float (&s)[NS][4], const float (&dp)[NS][4], const int (&limit)[2], const unsigned char* masked,
                                                const Visible& vis, i64 row, i64 j0, const float (&lr)[2], const float (&dr)[2], float scale,
                                                float scale2) {
    const int t = threadIdx.x % 4;
#pragma unroll
    for (int n = 0; n < NS; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int h = e >> 1, c = 8 * n + 2 * t + (e & 1);
            const bool seen = TEST == ALL_SEEN || (c < limit[h] && !(TEST == LIMITS_AND_MASK && masked[(row + 8 * h) * vis.mrow + (j0 + c) * vis.mcol]));
            const float prob = exp2_fast(seen ? scale2 * s[n][e] - lr[h] : -INFINITY);
            s[n][e] = prob * (dp[n][e] - dr[h]) * scale;
        }
}

// dk and dv's tile, transposed (this thread's keys `key` and `key + 8` by the query tile's columns
// from r0, seen for first <= c < last): st becomes P^T, dpt dS^T (P in base 2 as query_gradients').
template <int TEST, int NS>
__device__ __forceinline__ void key_gradients(float (&st)[NS][4], float (&dpt)[NS][4], const int (&first)[2], const int (&last)[2],
                                              const unsigned char* masked, const Visible& vis, i64 r0, i64 key, const float* l_row,
                                              const float* d_row, float scale, float scale2) {
    const int t = threadIdx.x % 4;
#pragma unroll
    for (int n = 0; n < NS; ++n) {
        // The thread's two columns' log-sum-exp and D, a load each (l_row and d_row are 16-byte
        // aligned; the copies' memory clobbers kept the compiler from sharing a load between the
        // elements that read it: 70 loads a tile where 2 NS do).
        const float2 l2 = *(const float2*)(l_row + 8 * n + 2 * t), d2 = *(const float2*)(d_row + 8 * n + 2 * t);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int c = 8 * n + 2 * t + (e & 1), h = e >> 1;
            const float l = e & 1 ? l2.y : l2.x, d = e & 1 ? d2.y : d2.x;
            const bool seen = TEST == ALL_SEEN ||
                              (c >= first[h] && c < last[h] && !(TEST == LIMITS_AND_MASK && masked[(r0 + c) * vis.mrow + (key + 8 * h) * vis.mcol]));
            const float prob = exp2_fast(seen ? scale2 * st[n][e] - LOG2E * l : -INFINITY);
            dpt[n][e] = seen ? prob * (dpt[n][e] - d) * scale : 0.0f;
            st[n][e] = prob;
        }
    }
}

// The rest of softmax_step once each row's max so far in the tile is in top: the rows' new max, s
// the exponentials of the scores less it, the sums, o scaled. FOLD: s and top hold the unscaled
// scores (0 < scale2 <= 1, so no finite score overflows once scaled), so the scaled max is scale2
// times the max (a rounding keeps the order of what it rounds: the same max as the scaled scores'),
// and each exponential's argument is one fused multiply-add, s scale2 - max, rounded once where the
// scaled score and the difference were rounded each (the argument within about a unit in the last
// place of the scaled score and of itself from before, P within ln 2 times that, relative; as the
// backward's recomputed P takes it). The exponentials' base: the running max, or 0 while a row has
// seen nothing (every score then -inf, so each exponential is 0, and alpha multiplies zeros): no
// branch an element.
template <bool FOLD, int NS, int NO>
__device__ __forceinline__ void exponentials(float (&s)[NS][4], float (&o)[NO][4], float (&mx)[2], float (&l)[2], const float (&top)[2],
                                             float scale2) {
    float alpha[2], base[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const float tile_max = quad<true>(top[h]);
        const float mnew = fmaxf(mx[h], FOLD ? scale2 * tile_max : tile_max);
        base[h] = mnew == -INFINITY ? 0.0f : mnew;
        alpha[h] = exp2_fast(mx[h] - base[h]);
        mx[h] = mnew;
        l[h] *= alpha[h];
    }
#pragma unroll
    for (int n = 0; n < NS; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            s[n][e] = exp2_fast(FOLD ? fmaf(s[n][e], scale2, -base[e >> 1]) : s[n][e] - base[e >> 1]);
            l[e >> 1] += s[n][e];
        }
#pragma unroll
    for (int c = 0; c < NO; ++c)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[c][e] *= alpha[e >> 1];
}

// One key tile's step of the forward's online softmax for a warp's 16 query rows from rw (the
// tile's keys from j0): s, their scores, become the probabilities (in base 2, not yet normalized),
// mx and l the two rows' running max and sum (of the thread's columns), o scaled to the new max.
// Scores in base 2 (times LOG2E), so their exponentials are exp2_fast's; where the warp's rows see
// every key of the tile and 0 < scale LOG2E <= 1 (a head of 3 or more at the default scale), the
// scale is folded into the exponentials (`exponentials`' FOLD: 30 multiplications fewer a tile of
// 64 keys).
template <int NS, int NO>
__device__ __forceinline__ void softmax_step(float (&s)[NS][4], float (&o)[NO][4], float (&mx)[2], float (&l)[2], const Problem<float>& p,
                                             const Visible& vis, const unsigned char* masked, i64 rw, i64 j0) {
    constexpr int BC = 8 * NS;
    const int g = (threadIdx.x % 32) / 4;
    const float scale2 = p.scale * LOG2E;
    float top[2] = {-INFINITY, -INFINITY};
    if (!masked && scale2 > 0.0f && scale2 <= 1.0f && all_seen(p, vis, rw, j0, BC)) {
#pragma unroll
        for (int n = 0; n < NS; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) top[e >> 1] = fmaxf(top[e >> 1], s[n][e]);
        exponentials<true>(s, o, mx, l, top, scale2);
    } else {
        if (!masked && all_seen(p, vis, rw, j0, BC)) {
            seen_scores<ALL_SEEN>(s, top, {0, 0}, masked, vis, rw + g, j0, scale2);
        } else {
            const int limit[2] = {keys_seen(p, vis, rw + g, j0, BC), keys_seen(p, vis, rw + g + 8, j0, BC)};
            if (masked) seen_scores<LIMITS_AND_MASK>(s, top, limit, masked, vis, rw + g, j0, scale2);
            else seen_scores<LIMITS>(s, top, limit, masked, vis, rw + g, j0, scale2);
        }
        exponentials<false>(s, o, mx, l, top, scale2);
    }
}

// The last key tile (exclusive) that a warp whose M tiles of 16 query rows start at rw multiplies:
// under a causal mask none past its last row (a tile that none of its rows sees would add nothing:
// zero probabilities, a factor of 1; only work), and none at all for a warp whose rows are all past
// the queries (never written).
template <int M>
__device__ __forceinline__ i64 keys_end(const Problem<float>& p, const Visible& vis, i64 rw) {
    if (rw >= p.tq) return 0;
    return vis.causal ? min(p.tk, rw + 16 * M) : p.tk;
}

// The forward of a block's 16 M MMA_WARPS query rows from r0 of matrix i (a warp's M tiles of 16
// rows), key tiles of BC rows.
template <int KIND, int D, int BC, int M>
__device__ void attention_mma_tile(const Problem<float>& p, const Visible& vis, const Bits& bits, float* out, const Addr& ao, float* lse, i64 i, i64 r0) {
    constexpr int LD = D / 2 + 4, KD = D / 16, NS = BC / 8, NO = D / 8;
    // Two buffers of key and value tiles: the next tile's copies run while this one's products do.
    __align__(16) __shared__ unsigned ks[2][BC * LD], vs[2][BC * LD];
    const int g = (threadIdx.x % 32) / 4, t = threadIdx.x % 4;
    const i64 rw = r0 + 16 * M * (threadIdx.x / 32), dp = padded8(p.d), dvp = padded8(p.dv);
    // Matrix i's rounded operands.
    const unsigned short *q0 = bits.q_of(i, p.heads), *k0 = bits.k_of(i, p.heads), *v0 = bits.v_of(i, p.heads);
    unsigned qa[M][KD][4];
#pragma unroll
    for (int mt = 0; mt < M; ++mt)
#pragma unroll
        for (int kk = 0; kk < KD; ++kk) load_a(qa[mt][kk], q0, bits.aq.row, dp, rw + 16 * mt, p.tq, 16 * kk);
    float o[M][NO][4], mx[M][2], l[M][2];
#pragma unroll
    for (int mt = 0; mt < M; ++mt) {
        zero_acc(o[mt]);
        mx[mt][0] = mx[mt][1] = -INFINITY;
        l[mt][0] = l[mt][1] = 0.0f;
    }
    const unsigned char* masked = vis.rows_of(i);
    // The block's key tiles, and this warp's.
    const i64 kend = vis.causal ? min(p.tk, r0 + 16 * M * MMA_WARPS) : p.tk, wend = keys_end<M>(p, vis, rw);
    KeyCopies<BC, D> copies(k0, bits.ak.row, v0, bits.av.row, dp, dvp);
    if (kend > 0) copies.stage(ks[0], vs[0], 0, p.tk);
    int buf = 0;
    for (i64 j0 = 0; j0 < kend; j0 += BC, buf ^= 1) {
        tile_arrives(j0 + BC < kend, [&] { copies.stage(ks[buf ^ 1], vs[buf ^ 1], j0 + BC, p.tk); });
        if (j0 < wend) {
            float s[M][NS][4];
            product<KIND>(s, qa, ks[buf], LD);
#pragma unroll
            for (int mt = 0; mt < M; ++mt) softmax_step(s[mt], o[mt], mx[mt], l[mt], p, vis, masked, rw + 16 * mt, j0);
            accumulate<KIND, true>(o, s, vs[buf], LD);
        }
    }
    float* out0 = out + matrix(ao, i, p.heads);
#pragma unroll
    for (int mt = 0; mt < M; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const float sum = quad<false>(l[mt][h]);
            const i64 r = rw + 16 * mt + g + 8 * h;
            if (r >= p.tq) continue;
            float* row = out0 + r * ao.row;
            // One division a row, not one (with its slow path's branches) an element.
            const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
#pragma unroll
            for (int c = 0; c < NO; ++c)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    int col = 8 * c + 2 * t + e;
                    if (col < p.dv) row[col] = o[mt][c][2 * h + e] * inv;
                }
            if (lse && t == 0) lse[i * p.tq + r] = sum > 0.0f ? LN2 * mx[mt][h] + logf(sum) : -INFINITY;
        }
    // Every warp is done with the tiles' buffers before the block's next task stages into them.
    __syncthreads();
}

// dq of a block's 16 M MMA_WARPS query rows from r0 of matrix i (a warp's M tiles of 16 rows), key
// tiles of BC rows (delta: the rows' D).
template <int KIND, int D, int BC, int M>
__device__ void attention_mma_backward_q_tile(const Problem<float>& p, const Visible& vis, const Bits& bits, const float* lse, const float* delta,
                                              float* gq, i64 i, i64 r0) {
    constexpr int LD = D / 2 + 4, KD = D / 16, NS = BC / 8, NO = D / 8;
    // Two buffers of key and value tiles, as the forward's.
    __align__(16) __shared__ unsigned ks[2][BC * LD], vs[2][BC * LD];
    const int g = (threadIdx.x % 32) / 4, t = threadIdx.x % 4;
    const i64 rw = r0 + 16 * M * (threadIdx.x / 32), dp = padded8(p.d), dvp = padded8(p.dv);
    float* gq0 = gq + matrix(p.aq, i, p.heads);
    // Matrix i's rounded operands.
    const unsigned short *q0 = bits.q_of(i, p.heads), *g0 = bits.g_of(i, p.heads), *k0 = bits.k_of(i, p.heads),
                         *v0 = bits.v_of(i, p.heads);
    unsigned qa[M][KD][4], ga[M][KD][4];
#pragma unroll
    for (int mt = 0; mt < M; ++mt)
#pragma unroll
        for (int kk = 0; kk < KD; ++kk) {
            load_a(qa[mt][kk], q0, bits.aq.row, dp, rw + 16 * mt, p.tq, 16 * kk);
            load_a(ga[mt][kk], g0, bits.ag.row, dvp, rw + 16 * mt, p.tq, 16 * kk);
        }
    float acc[M][NO][4], lr[M][2], dr[M][2];
    const unsigned char* masked = vis.rows_of(i);
#pragma unroll
    for (int mt = 0; mt < M; ++mt) {
        zero_acc(acc[mt]);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const i64 r = rw + 16 * mt + g + 8 * h;
            lr[mt][h] = r < p.tq ? LOG2E * lse[i * p.tq + r] : 0.0f;
            dr[mt][h] = r < p.tq ? delta[i * p.tq + r] : 0.0f;
        }
    }
    // The block's key tiles, and this warp's.
    const i64 kend = vis.causal ? min(p.tk, r0 + 16 * M * MMA_WARPS) : p.tk, wend = keys_end<M>(p, vis, rw);
    KeyCopies<BC, D> copies(k0, bits.ak.row, v0, bits.av.row, dp, dvp);
    if (kend > 0) copies.stage(ks[0], vs[0], 0, p.tk);
    int buf = 0;
    for (i64 j0 = 0; j0 < kend; j0 += BC, buf ^= 1) {
        tile_arrives(j0 + BC < kend, [&] { copies.stage(ks[buf ^ 1], vs[buf ^ 1], j0 + BC, p.tk); });
        if (j0 < wend) {
            float s[M][NS][4], dp_[M][NS][4];
            product<KIND>(s, qa, ks[buf], LD);
            product<KIND>(dp_, ga, vs[buf], LD);
#pragma unroll
            for (int mt = 0; mt < M; ++mt) {
                const i64 rm = rw + 16 * mt;
                if (!masked && all_seen(p, vis, rm, j0, BC)) {
                    query_gradients<ALL_SEEN>(s[mt], dp_[mt], {0, 0}, masked, vis, rm + g, j0, lr[mt], dr[mt], p.scale, p.scale * LOG2E);
                } else {
                    const int limit[2] = {keys_seen(p, vis, rm + g, j0, BC), keys_seen(p, vis, rm + g + 8, j0, BC)};
                    if (masked)
                        query_gradients<LIMITS_AND_MASK>(s[mt], dp_[mt], limit, masked, vis, rm + g, j0, lr[mt], dr[mt], p.scale, p.scale * LOG2E);
                    else query_gradients<LIMITS>(s[mt], dp_[mt], limit, masked, vis, rm + g, j0, lr[mt], dr[mt], p.scale, p.scale * LOG2E);
                }
            }
            accumulate<KIND, false>(acc, s, ks[buf], LD);
        }
    }
#pragma unroll
    for (int mt = 0; mt < M; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const i64 r = rw + 16 * mt + g + 8 * h;
            if (r >= p.tq) continue;
#pragma unroll
            for (int c = 0; c < NO; ++c)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    int col = 8 * c + 2 * t + e;
                    if (col < p.d) gq0[r * p.aq.row + col] = acc[mt][c][2 * h + e];
                }
        }
    // Every warp is done with the tiles' buffers before the block's next task stages into them.
    __syncthreads();
}

// dk and dv of a block's 16 M MMA_WARPS key rows from j0 of matrix i (a warp's M tiles of 16 rows),
// from every query row that sees them, query tiles of KR rows (delta: the rows' D). Under a causal
// mask a warp multiplies only the query tiles that see its keys (from the one holding its first
// key's row), and a warp whose keys are all past the keys none.
template <int KIND, int D, int KR, int M>
__device__ void attention_mma_backward_kv_tile(const Problem<float>& p, const Visible& vis, const Bits& bits, const float* lse,
                                               const float* delta, float* gk, float* gv, i64 i, i64 j0) {
    constexpr int LD = D / 2 + 4, KD = D / 16, NS = KR / 8, NO = D / 8;
    // Two buffers of query and output-gradient tiles (with their rows' log-sum-exp and D), as the
    // forward's key and value tiles.
    __align__(16) __shared__ unsigned qs[2][KR * LD], gs[2][KR * LD];
    __align__(16) __shared__ float l_row[2][KR], d_row[2][KR];
    const int g = (threadIdx.x % 32) / 4, t = threadIdx.x % 4;
    const i64 jw = j0 + 16 * M * (threadIdx.x / 32), dp = padded8(p.d), dvp = padded8(p.dv);
    // Matrix i's rounded operands.
    const unsigned short *q0 = bits.q_of(i, p.heads), *g0 = bits.g_of(i, p.heads), *k0 = bits.k_of(i, p.heads),
                         *v0 = bits.v_of(i, p.heads);
    unsigned ka[M][KD][4], va[M][KD][4];
#pragma unroll
    for (int mt = 0; mt < M; ++mt)
#pragma unroll
        for (int kk = 0; kk < KD; ++kk) {
            load_a(ka[mt][kk], k0, bits.ak.row, dp, jw + 16 * mt, p.tk, 16 * kk);
            load_a(va[mt][kk], v0, bits.av.row, dvp, jw + 16 * mt, p.tk, 16 * kk);
        }
    float dk[M][NO][4], dv[M][NO][4];
#pragma unroll
    for (int mt = 0; mt < M; ++mt) {
        zero_acc(dk[mt]);
        zero_acc(dv[mt]);
    }
    const unsigned char* masked = vis.rows_of(i);
    // The block's first query tile, and this warp's.
    const i64 rstart = vis.causal ? (j0 / KR) * KR : 0, wstart = jw >= p.tk ? p.tq : vis.causal ? (jw / KR) * KR : 0;
    Copies<KR, D, LD> q_copies(q0, bits.aq.row, dp, rstart), g_copies(g0, bits.ag.row, dvp, rstart);
    // The tile's rows' log-sum-exp and D: where both of matrix i's are 16-byte aligned and the tile
    // lies inside the queries, 16 bytes a copy (threads below KR / 4 the log-sum-exp, the next KR / 4
    // D) from an address that moves on KR rows a tile; else 4 bytes a row (threads below KR).
    static_assert(KR % 4 == 0 && KR / 2 <= 32, "a tile's values are whole 16-byte copies of warp 0");
    const float *lse_i = lse + i * p.tq, *delta_i = delta + i * p.tq;
    const bool aligned = (((unsigned long long)lse_i | (unsigned long long)delta_i) & 15) == 0;
    const int quad_row = 4 * ((int)threadIdx.x % (KR / 4));
    const float* values = (threadIdx.x < KR / 4 ? lse_i : delta_i) + rstart + quad_row;
    auto stage = [&](int b, i64 r0) {
        q_copies.stage(qs[b], r0, p.tq);
        g_copies.stage(gs[b], r0, p.tq);
        if (aligned && r0 + KR <= p.tq) {
            if (threadIdx.x < KR / 2) cp_async<16>((threadIdx.x < KR / 4 ? l_row[b] : d_row[b]) + quad_row, values, true);
        } else if (threadIdx.x < KR) {
            const i64 r = r0 + threadIdx.x;
            const bool inside = r < p.tq;
            cp_async<4>(&l_row[b][threadIdx.x], lse_i + (inside ? r : 0), inside);
            cp_async<4>(&d_row[b][threadIdx.x], delta_i + (inside ? r : 0), inside);
        }
        values += KR;
        cp_async_commit();
    };
    if (rstart < p.tq) stage(0, rstart);
    int buf = 0;
    for (i64 r0 = rstart; r0 < p.tq; r0 += KR, buf ^= 1) {
        tile_arrives(r0 + KR < p.tq, [&] { stage(buf ^ 1, r0 + KR); });
        if (r0 >= wstart) {
            // The transposed scores S^T = K Q^T and dP^T = V dO^T: this warp's keys by the tile's queries.
            float st[M][NS][4], dpt[M][NS][4];
            product<KIND>(st, ka, qs[buf], LD);
            product<KIND>(dpt, va, gs[buf], LD);
#pragma unroll
            for (int mt = 0; mt < M; ++mt) {
                const i64 jm = jw + 16 * mt;
                // The queries of the tile that this thread's two keys are seen by, r0 + c for first
                // <= c < last: none for a key past the keys, none past the queries, under a causal
                // mask only from the key's own row.
                // Every query of the tile sees all 16 of the tile's keys where the tile lies inside
                // the queries and, under a causal mask, the last key is at or before the tile's
                // first query (a key past the keys may see anything: it is never written). The same
                // for the warp's lanes, so its element loop does not diverge. Heads up to 64 only:
                // the d128 kernels hold dk, dv and K's and V's fragments in registers, and a third
                // loop made them spill 48 (bf16) and 64 (fp16) bytes where they now spill 8 and 24.
                if (D <= 64 && !masked && r0 + KR <= p.tq && (!vis.causal || jm + 15 <= r0)) {
                    key_gradients<ALL_SEEN>(st[mt], dpt[mt], {0, 0}, {0, 0}, masked, vis, r0, jm + g, l_row[buf], d_row[buf], p.scale, p.scale * LOG2E);
                } else {
                    int first[2], last[2];
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const i64 j = jm + g + 8 * h;
                        last[h] = j < p.tk ? (int)min((i64)KR, p.tq - r0) : 0;
                        first[h] = vis.causal ? (int)min((i64)KR, max((i64)0, j - r0)) : 0;
                    }
                    if (masked)
                        key_gradients<LIMITS_AND_MASK>(st[mt], dpt[mt], first, last, masked, vis, r0, jm + g, l_row[buf], d_row[buf], p.scale,
                                                       p.scale * LOG2E);
                    else key_gradients<LIMITS>(st[mt], dpt[mt], first, last, masked, vis, r0, jm + g, l_row[buf], d_row[buf], p.scale, p.scale * LOG2E);
                }
            }
            // dv += P^T dO and dk += dS^T Q.
            accumulate<KIND, true>(dv, st, gs[buf], LD);
            accumulate<KIND, false>(dk, dpt, qs[buf], LD);
        }
    }
    // Matrix i's gradients found once (`matrix` divides), not at every store of the unrolled loop.
    float *gk0 = gk ? gk + matrix(p.ak, i, p.heads) : nullptr, *gv0 = gv ? gv + matrix(p.av, i, p.heads) : nullptr;
#pragma unroll
    for (int mt = 0; mt < M; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const i64 j = jw + 16 * mt + g + 8 * h;
            if (j >= p.tk) continue;
#pragma unroll
            for (int c = 0; c < NO; ++c)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    int col = 8 * c + 2 * t + e;
                    if (gk0 && col < p.d) gk0[j * p.ak.row + col] = dk[mt][c][2 * h + e];
                    if (gv0 && col < p.dv) gv0[j * p.av.row + col] = dv[mt][c][2 * h + e];
                }
        }
    // Every warp is done with the tiles' buffers before the block's next task stages into them.
    __syncthreads();
}

// The entry points for head sizes up to D with KIND's operands (SUF), their rounded copies in `bits`
// (q, k and v; the output's gradient too in backward): blocks of MMA_WARPS warps, each warp M tiles
// of 16 rows, walk the (matrix, tile) pairs of 16 M MMA_WARPS rows, in task_tile's order. The
// forward meets key tiles of FC rows, dq key tiles of QC, dk and dv query tiles of KR; each
// kernel's two buffers of tiles fit the 48 KiB of static shared memory (so the d128 forward's key
// tiles are 32 rows, d64's 64). BLOCKS: the blocks a multiprocessor should hold at once, so the
// registers a thread may take (3: 168 of an H100's 65,536 per multiprocessor; with tiles of 64 the
// backward kernels took 255, two blocks of 4 warps, and spilled at 168; the d128 kernels spill at
// 168, so they take what they need).
#define ATTENTION_MMA_FORWARD(NAME, M, KIND, SUF, D, FC, BLOCKS)                                       \
    extern "C" __global__ void __launch_bounds__(128, BLOCKS) attention_##NAME##_d##D##_##SUF(Problem<float> p, Visible vis, Bits bits, float* out, Addr ao, float* lse) { \
        constexpr i64 rows = 16 * M * MMA_WARPS;                                                        \
        i64 tiles = (p.tq + rows - 1) / rows;                                                           \
        for (i64 t = blockIdx.x; t < p.bh * tiles; t += gridDim.x)                                      \
            attention_mma_tile<KIND, D, FC, M>(p, vis, bits, out, ao, lse, t / tiles, task_tile(t, tiles, vis.causal) * rows); \
    }
#define ATTENTION_MMA_Q(NAME, M, KIND, SUF, D, QC, BLOCKS)                                             \
    extern "C" __global__ void __launch_bounds__(128, BLOCKS) attention_##NAME##_backward_q_d##D##_##SUF(Problem<float> p, Visible vis, Bits bits, const float* lse, const float* delta, float* gq) { \
        constexpr i64 rows = 16 * M * MMA_WARPS;                                                        \
        i64 tiles = (p.tq + rows - 1) / rows;                                                           \
        for (i64 t = blockIdx.x; t < p.bh * tiles; t += gridDim.x)                                      \
            attention_mma_backward_q_tile<KIND, D, QC, M>(p, vis, bits, lse, delta, gq, t / tiles, task_tile(t, tiles, vis.causal) * rows); \
    }
#define ATTENTION_MMA_KV(NAME, M, KIND, SUF, D, KR, BLOCKS)                                            \
    extern "C" __global__ void __launch_bounds__(128, BLOCKS) attention_##NAME##_backward_kv_d##D##_##SUF(Problem<float> p, Visible vis, Bits bits, const float* lse, const float* delta, float* gk, float* gv) { \
        constexpr i64 rows = 16 * M * MMA_WARPS;                                                        \
        i64 tiles = (p.tk + rows - 1) / rows;                                                           \
        for (i64 t = blockIdx.x; t < p.bh * tiles; t += gridDim.x)                                      \
            attention_mma_backward_kv_tile<KIND, D, KR, M>(p, vis, bits, lse, delta, gk, gv, t / tiles, task_tile(t, tiles, false) * rows); \
    }
// A warp a tile of 16 rows (`attention_mma_*`).
#define ATTENTION_MMA(KIND, SUF, D, FC, QC, KR, BLOCKS)                                                 \
    ATTENTION_MMA_FORWARD(mma, 1, KIND, SUF, D, FC, BLOCKS)                                             \
    ATTENTION_MMA_Q(mma, 1, KIND, SUF, D, QC, BLOCKS)                                                   \
    ATTENTION_MMA_KV(mma, 1, KIND, SUF, D, KR, BLOCKS)

ATTENTION_MMA(1, bf16, 64, 64, 32, 32, 3)
ATTENTION_MMA(1, bf16, 128, 32, 32, 32, 1)
ATTENTION_MMA(2, f16, 64, 64, 32, 32, 3)
ATTENTION_MMA(2, f16, 128, 32, 32, 32, 1)

// Two tiles of 16 rows a warp (`attention_mma_wide_*`, the forward and dq, heads up to 64: the
// `MEMFIT_CUDA_ATTENTION=wide` kernels): each of B's fragments is read from shared memory once for
// two products, and a warp has twice the independent products in flight, in 255 registers (two
// blocks a multiprocessor). The same bits as the kernels above for finite operands: each row meets
// the same key tiles that it sees, its products, sums and tiles in the same order (a warp of either
// width skips tiles that none of its rows sees, which would add exact zeros, or NaN from an
// infinite operand). (dk and dv keep a tile a warp: two would hold
// dk's, dv's, K's and V's fragments of 32 keys, 192 registers, and spilled 652 bytes.)
#define ATTENTION_MMA_WIDE(KIND, SUF, D, FC, QC)                                                        \
    ATTENTION_MMA_FORWARD(mma_wide, 2, KIND, SUF, D, FC, 2)                                             \
    ATTENTION_MMA_Q(mma_wide, 2, KIND, SUF, D, QC, 2)

ATTENTION_MMA_WIDE(1, bf16, 64, 64, 32)
ATTENTION_MMA_WIDE(2, f16, 64, 64, 32)

// The tensor cores' check, run once before the kernels above are used: one warp multiplies
// A(r, k) = (3 r + 5 k) % 7 - 3 by B(k, n) = (2 k + 3 n) % 5 - 2 (small integers: every sum exact in
// any order) through mma_16816 three times, each lane building its A fragment as the kernels do and
// its B fragment (0) in registers, (1) through ldmatrix from a tile stored B(k, n) = tile[n][k],
// (2) through ldmatrix's transpose from a tile stored B(k, n) = tile[k][n], both tiles copied into
// shared memory by cp_async; product j's lane l writes its d[i] to out[128 j + 4 l + i], and the
// host compares them with the product (`mma_check_error` in the cuda backend), so fragments laid
// out otherwise than this GPU's fail there, not in training.
template <int KIND>
__device__ void mma_check(float* out) {
    const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    auto a_at = [](int r, int k) { return float((3 * r + 5 * k) % 7 - 3); };
    auto b_at = [](int k, int n) { return float((2 * k + 3 * n) % 5 - 2); };
    unsigned a[4], b[3][2];
    for (int q = 0; q < 4; ++q) {
        int r = g + 8 * (q & 1), k = 2 * t + 8 * (q >> 1);
        a[q] = operand_pair<KIND>(a_at(r, k), a_at(r, k + 1));
    }
    for (int q = 0; q < 2; ++q) b[0][q] = operand_pair<KIND>(b_at(2 * t + 8 * q, g), b_at(2 * t + 8 * q + 1, g));
    // The tiles, written to `out` (global memory) first and copied as the kernels stage: by n (8
    // rows of 16 k, 12 words apart) and by k (16 rows of 8 n, 4 words apart).
    __align__(16) __shared__ unsigned by_n[8 * 12], by_k[16 * 4];
    unsigned* from = (unsigned*)out;
    for (int w = lane; w < 8 * 12; w += 32) {
        const int n = w / 12, k = 2 * (w % 12);
        from[w] = k < 16 ? operand_pair<KIND>(b_at(k, n), b_at(k + 1, n)) : 0u;
    }
    for (int w = lane; w < 16 * 4; w += 32) from[96 + w] = operand_pair<KIND>(b_at(w / 4, 2 * (w % 4)), b_at(w / 4, 2 * (w % 4) + 1));
    __syncthreads();
    for (int c = lane; c < (8 * 12 + 16 * 4) / 4; c += 32) cp_async<16>(c < 24 ? by_n + 4 * c : by_k + 4 * (c - 24), from + 4 * c, true);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    // Matrix m (lanes 8 m .. 8 m + 7 give its rows) of the four: the k halves of B, twice.
    const int m = (lane / 8) & 1;
    unsigned r[4];
    ldmatrix_x4<false>(r, by_n + (lane % 8) * 12 + 4 * m);
    b[1][0] = r[0];
    b[1][1] = r[1];
    ldmatrix_x4<true>(r, by_k + (8 * m + lane % 8) * 4);
    b[2][0] = r[0];
    b[2][1] = r[1];
    __syncthreads();
    for (int j = 0; j < 3; ++j) {
        float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        mma_16816<KIND>(d, a, b[j]);
        for (int i = 0; i < 4; ++i) out[128 * j + 4 * lane + i] = d[i];
    }
}

extern "C" __global__ void attention_mma_check_bf16(float* out) { mma_check<1>(out); }
extern "C" __global__ void attention_mma_check_f16(float* out) { mma_check<2>(out); }
