// Scaled dot-product attention, forward and backward, in two forms; both repeat bit for bit (fixed
// orders, no atomics) and need no scratch memory (O(T) memory, as the cpu path: only the per-row
// log-sum-exp is saved).
// - Tiled (f32, head sizes up to 128; below): a block of 128 threads takes a tile of query rows (the
//   forward, the backward's D and dq) or of key rows (dk and dv), stages the other side's rows in
//   shared memory a tile at a time and keeps its own results in registers, with the online softmax
//   of FlashAttention (Dao, 2022). A causal block stops at (or starts from) the diagonal.
// - Per row (f64, larger heads): one thread per query or key row walking its row in order.
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

// D = sum_j P[r, j] dP[r, j] of query row r of matrix i (g: the output's gradient, laid out as v's
// rows but with the output's Addr ag).
template <typename T>
__device__ T row_d(const Problem<T>& p, const Visible& vis, const T* g, const Addr& ag, const T* lse, i64 i, i64 r) {
    const T* qr = p.qrow(i, r);
    const T* gr = g + matrix(ag, i, p.heads) + r * ag.row;
    T l = lse[i * p.tq + r], acc = T(0);
    for (i64 j = 0; j < p.tk; ++j) {
        if (vis.hidden(i, r, j)) continue;
        T prob = exp(p.scale * dot<T>(p, qr, p.krow(i, j), p.d) - l);
        acc += prob * dot<T>(p, gr, p.vrow(i, j), p.dv);
    }
    return acc;
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
    /* D of every query row into the first element of its dq row (read back by the next kernels). */    \
    extern "C" __global__ void attention_backward_d_##SUF(Problem<T> p, Visible vis, const T* g, Addr ag, const T* lse, T* gq) { \
        GRID_STRIDE(row, p.bh * p.tq) {                                                                 \
            i64 i = row / p.tq, r = row % p.tq;                                                         \
            gq[matrix(p.aq, i, p.heads) + r * p.aq.row] = row_d<T>(p, vis, g, ag, lse, i, r);           \
        }                                                                                               \
    }                                                                                                   \
    /* dk and dv of every key row, each when given; D from dq's rows, or computed (no dq). */           \
    extern "C" __global__ void attention_backward_kv_##SUF(Problem<T> p, Visible vis, const T* g, Addr ag, const T* lse, const T* gq, T* gk, T* gv) { \
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
                    T dd = gq ? gq[matrix(p.aq, i, p.heads) + r * p.aq.row] : row_d<T>(p, vis, g, ag, lse, i, r); \
                    T ds = prob * (dot<T>(p, gr, vj, p.dv) - dd) * p.scale;                             \
                    for (i64 c = 0; c < p.d; ++c) dk[c] += p.in(ds) * p.in(qr[c]);                      \
                }                                                                                       \
            }                                                                                           \
        }                                                                                               \
    }                                                                                                   \
    /* dq of every query row, its D read from the row's first element before the row is written. */     \
    extern "C" __global__ void attention_backward_q_##SUF(Problem<T> p, Visible vis, const T* g, Addr ag, const T* lse, T* gq) { \
        GRID_STRIDE(row, p.bh * p.tq) {                                                                 \
            i64 i = row / p.tq, r = row % p.tq;                                                         \
            const T* qr = p.qrow(i, r);                                                                 \
            const T* gr = g + matrix(ag, i, p.heads) + r * ag.row;                                      \
            T* dq = gq + matrix(p.aq, i, p.heads) + r * p.aq.row;                                       \
            T dd = dq[0], l = lse[row];                                                                 \
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
// into `sh`, as the problem's products read them (every staged tile is a product's operand).
template <int D, int ROWS>
__device__ void stage_rows(const Problem<float>& p, float* sh, const float* m, i64 stride, i64 r0, i64 rows, i64 cols) {
    for (int e = threadIdx.x; e < ROWS * D; e += TILE_THREADS) {
        int a = e / D, c = e % D;
        sh[a * (D + 1) + c] = (r0 + a < rows && c < cols) ? p.in(m[(r0 + a) * stride + c]) : 0.0f;
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
    float o[TM][TO], m[TM], l[TM];
    zero_tile(o);
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
        for (int a = 0; a < TM; ++a) {
            i64 r = r0 + ty * TM + a;
            top[a] = -INFINITY;
            for (int b = 0; b < TN; ++b) {
                i64 j = j0 + tx + TX * b;
                bool seen = r < p.tq && j < p.tk && !vis.hidden(i, r, j);
                s[a][b] = seen ? p.scale * s[a][b] : -INFINITY;
                top[a] = fmaxf(top[a], s[a][b]);
            }
        }
        merge_rows<TM, true>(top, red);
        for (int a = 0; a < TM; ++a) {
            float mnew = fmaxf(m[a], top[a]), alpha = 1.0f;
            sum[a] = 0.0f;
            if (mnew != -INFINITY) {
                alpha = expf(m[a] - mnew);
                for (int b = 0; b < TN; ++b) { s[a][b] = expf(s[a][b] - mnew); sum[a] += s[a][b]; }
                m[a] = mnew;
            } else {
                for (int b = 0; b < TN; ++b) s[a][b] = 0.0f;
            }
            l[a] *= alpha;
            for (int c = 0; c < TO; ++c) o[a][c] *= alpha;
            for (int b = 0; b < TN; ++b) ps[(ty * TM + a) * (BC + 1) + tx + TX * b] = p.in(s[a][b]);
        }
        merge_rows<TM, false>(sum, red);
        for (int a = 0; a < TM; ++a) l[a] += sum[a];
        tile_product<TM, TO, BC>(o, ps, BC + 1, 1, vs, D + 1, 1);
    }
    for (int a = 0; a < TM; ++a) {
        i64 r = r0 + ty * TM + a;
        if (r >= p.tq) continue;
        float* row = out + matrix(ao, i, p.heads) + r * ao.row;
        for (int c = 0; c < TO; ++c) {
            int col = tx + TX * c;
            if (col < p.dv) row[col] = l[a] > 0.0f ? o[a][c] / l[a] : 0.0f;
        }
        if (lse && tx == 0) lse[i * p.tq + r] = l[a] > 0.0f ? m[a] + logf(l[a]) : -INFINITY;
    }
    __syncthreads();
}

// The backward over one tile of BR query rows, key tiles of BC rows at a time. pass 0: D of each
// row (sum over keys of P dP) into the first element of its dq row; pass 1: dq of each row, its D
// read from there first.
template <int D, int BR, int BC>
__device__ void attention_backward_q_tile(const Problem<float>& p, const Visible& vis, const float* g, const Addr& ag, const float* lse,
                                          float* gq, int pass, i64 i, i64 r0) {
    constexpr int TM = BR / TY, TN = BC / TX, TO = D / TX;
    __shared__ float qs[BR * (D + 1)], gs[BR * (D + 1)], ks[BC * (D + 1)], vs[BC * (D + 1)], dss[BR * (BC + 1)], red[BR * TX];
    const int ty = threadIdx.x / TX, tx = threadIdx.x % TX;
    float acc[TM][TO], lr[TM], dr[TM], part[TM];
    zero_tile(acc);
    float* gq0 = gq + matrix(p.aq, i, p.heads);
    stage_rows<D, BR>(p, qs, p.q + matrix(p.aq, i, p.heads), p.aq.row, r0, p.tq, p.d);
    stage_rows<D, BR>(p, gs, g + matrix(ag, i, p.heads), ag.row, r0, p.tq, p.dv);
    for (int a = 0; a < TM; ++a) {
        i64 r = r0 + ty * TM + a;
        lr[a] = r < p.tq ? lse[i * p.tq + r] : 0.0f;
        dr[a] = (pass == 1 && r < p.tq) ? gq0[r * p.aq.row] : 0.0f;
        part[a] = 0.0f;
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
        for (int a = 0; a < TM; ++a) {
            i64 r = r0 + ty * TM + a;
            for (int b = 0; b < TN; ++b) {
                i64 j = j0 + tx + TX * b;
                bool seen = r < p.tq && j < p.tk && !vis.hidden(i, r, j);
                float prob = seen ? expf(p.scale * s[a][b] - lr[a]) : 0.0f;
                if (pass == 0) part[a] += prob * dp[a][b];
                else dss[(ty * TM + a) * (BC + 1) + tx + TX * b] = p.in(prob * (dp[a][b] - dr[a]) * p.scale);
            }
        }
        if (pass == 1) {
            __syncthreads();
            tile_product<TM, TO, BC>(acc, dss, BC + 1, 1, ks, D + 1, 1);
        }
    }
    if (pass == 0) {
        merge_rows<TM, false>(part, red);
        for (int a = 0; a < TM; ++a) {
            i64 r = r0 + ty * TM + a;
            if (tx == 0 && r < p.tq) gq0[r * p.aq.row] = part[a];
        }
    } else {
        for (int a = 0; a < TM; ++a) {
            i64 r = r0 + ty * TM + a;
            if (r >= p.tq) continue;
            for (int c = 0; c < TO; ++c) {
                int col = tx + TX * c;
                if (col < p.d) gq0[r * p.aq.row + col] = acc[a][c];
            }
        }
    }
    __syncthreads();
}

// dk and dv of one tile of KC key rows, from every query row that sees them, KR query rows at a
// time (D from dq's rows).
template <int D, int KR, int KC>
__device__ void attention_backward_kv_tile(const Problem<float>& p, const Visible& vis, const float* g, const Addr& ag, const float* lse,
                                           const float* gq, float* gk, float* gv, i64 i, i64 j0) {
    constexpr int TM = KR / TY, TN = KC / TX, UM = KC / TY, TO = D / TX;
    __shared__ float ks[KC * (D + 1)], vs[KC * (D + 1)], qs[KR * (D + 1)], gs[KR * (D + 1)];
    __shared__ float ps[KR * (KC + 1)], dss[KR * (KC + 1)], l_row[KR], d_row[KR];
    const int ty = threadIdx.x / TX, tx = threadIdx.x % TX;
    float dk[UM][TO], dv[UM][TO];
    zero_tile(dk);
    zero_tile(dv);
    const float* gq0 = gq + matrix(p.aq, i, p.heads);
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
            d_row[threadIdx.x] = r < p.tq ? gq0[r * p.aq.row] : 0.0f;
        }
        __syncthreads();
        float s[TM][TN], dp[TM][TN];
        zero_tile(s);
        zero_tile(dp);
        tile_product<TM, TN, D>(s, qs, D + 1, 1, ks, 1, D + 1);
        tile_product<TM, TN, D>(dp, gs, D + 1, 1, vs, 1, D + 1);
        for (int a = 0; a < TM; ++a) {
            int row = ty * TM + a;
            i64 r = r0 + row;
            for (int b = 0; b < TN; ++b) {
                int col = tx + TX * b;
                i64 j = j0 + col;
                bool seen = r < p.tq && j < p.tk && !vis.hidden(i, r, j);
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
    for (int a = 0; a < UM; ++a) {
        i64 j = j0 + ty * UM + a;
        if (j >= p.tk) continue;
        for (int c = 0; c < TO; ++c) {
            int col = tx + TX * c;
            if (gk && col < p.d) gk[matrix(p.ak, i, p.heads) + j * p.ak.row + col] = dk[a][c];
            if (gv && col < p.dv) gv[matrix(p.av, i, p.heads) + j * p.av.row + col] = dv[a][c];
        }
    }
    __syncthreads();
}

// The entry points for head sizes up to D: blocks walk the (matrix, tile) pairs, so a block's
// threads always agree on their tile (the barriers inside need that). The forward's query tiles of
// FR rows meet key tiles of FC rows; D and dq's query tiles of QR rows meet key tiles of QC; dk and
// dv's key tiles of KC rows meet query tiles of KR. Row counts are multiples of TY, column counts of
// TX; each tile set fits the 48 KiB of static shared memory.
#define ATTENTION_TILED(D, FR, FC, QR, QC, KC, KR)                                                      \
    extern "C" __global__ void attention_tiled_d##D##_f32(Problem<float> p, Visible vis, float* out, Addr ao, float* lse) { \
        i64 tiles = (p.tq + FR - 1) / FR;                                                               \
        for (i64 t = blockIdx.x; t < p.bh * tiles; t += gridDim.x)                                      \
            attention_tile<D, FR, FC>(p, vis, out, ao, lse, t / tiles, (t % tiles) * FR);               \
    }                                                                                                   \
    extern "C" __global__ void attention_tiled_backward_q_d##D##_f32(Problem<float> p, Visible vis, const float* g, Addr ag, const float* lse, float* gq, int pass) { \
        i64 tiles = (p.tq + QR - 1) / QR;                                                               \
        for (i64 t = blockIdx.x; t < p.bh * tiles; t += gridDim.x)                                      \
            attention_backward_q_tile<D, QR, QC>(p, vis, g, ag, lse, gq, pass, t / tiles, (t % tiles) * QR); \
    }                                                                                                   \
    extern "C" __global__ void attention_tiled_backward_kv_d##D##_f32(Problem<float> p, Visible vis, const float* g, Addr ag, const float* lse, const float* gq, float* gk, float* gv) { \
        i64 tiles = (p.tk + KC - 1) / KC;                                                               \
        for (i64 t = blockIdx.x; t < p.bh * tiles; t += gridDim.x)                                      \
            attention_backward_kv_tile<D, KR, KC>(p, vis, g, ag, lse, gq, gk, gv, t / tiles, (t % tiles) * KC); \
    }

ATTENTION_TILED(64, 64, 32, 32, 32, 32, 32)
ATTENTION_TILED(128, 32, 16, 16, 16, 16, 16)
