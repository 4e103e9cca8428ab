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

// The operands and sizes every kernel takes.
template <typename T>
struct Problem {
    const T* q;
    const T* k;
    const T* v;
    Addr aq, ak, av;
    i64 bh, heads, tq, tk, d, dv;
    T scale;
    __device__ const T* qrow(i64 i, i64 r) const { return q + matrix(aq, i, heads) + r * aq.row; }
    __device__ const T* krow(i64 i, i64 j) const { return k + matrix(ak, i, heads) + j * ak.row; }
    __device__ const T* vrow(i64 i, i64 j) const { return v + matrix(av, i, heads) + j * av.row; }
};

template <typename T>
__device__ T dot(const T* a, const T* b, i64 n) {
    T s = T(0);
    for (i64 c = 0; c < n; ++c) s += a[c] * b[c];
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
        T prob = exp(p.scale * dot<T>(qr, p.krow(i, j), p.d) - l);
        acc += prob * dot<T>(gr, p.vrow(i, j), p.dv);
    }
    return acc;
}

#define ATTENTION(T, SUF)                                                                               \
    extern "C" __global__ void attention_##SUF(Problem<T> p, Visible vis, T* out, Addr ao, T* lse) {   \
        GRID_STRIDE(row, p.bh * p.tq) {                                                                 \
            i64 i = row / p.tq, r = row % p.tq;                                                         \
            const T* qr = p.qrow(i, r);                                                                 \
            T* o = out + matrix(ao, i, p.heads) + r * ao.row;                                           \
            for (i64 c = 0; c < p.dv; ++c) o[c] = T(0);                                                 \
            T m = -INFINITY, l = T(0);                                                                  \
            for (i64 j = 0; j < p.tk; ++j) {                                                            \
                if (vis.hidden(i, r, j)) continue;                                                      \
                T s = p.scale * dot<T>(qr, p.krow(i, j), p.d);                                          \
                if (s > m) {                                                                            \
                    T alpha = exp(m - s);                                                               \
                    for (i64 c = 0; c < p.dv; ++c) o[c] *= alpha;                                       \
                    l *= alpha;                                                                         \
                    m = s;                                                                              \
                }                                                                                       \
                T e = exp(s - m);                                                                       \
                l += e;                                                                                 \
                const T* vj = p.vrow(i, j);                                                             \
                for (i64 c = 0; c < p.dv; ++c) o[c] += e * vj[c];                                       \
            }                                                                                           \
            if (l > T(0))                                                                               \
                for (i64 c = 0; c < p.dv; ++c) o[c] /= l;                                               \
            if (lse) lse[row] = l > T(0) ? m + log(l) : -INFINITY;                                      \
        }                                                                                               \
    }                                                                                                   \
    /* D of every query row into the first element of its dq row (read back by the next kernels). */  \
    extern "C" __global__ void attention_backward_d_##SUF(Problem<T> p, Visible vis, const T* g, Addr ag, const T* lse, T* gq) { \
        GRID_STRIDE(row, p.bh * p.tq) {                                                                 \
            i64 i = row / p.tq, r = row % p.tq;                                                         \
            gq[matrix(p.aq, i, p.heads) + r * p.aq.row] = row_d<T>(p, vis, g, ag, lse, i, r);            \
        }                                                                                               \
    }                                                                                                   \
    /* dk and dv of every key row, each when given; D from dq's rows, or computed (no dq). */        \
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
                T prob = exp(p.scale * dot<T>(qr, kj, p.d) - lse[i * p.tq + r]);                         \
                if (dvr) for (i64 c = 0; c < p.dv; ++c) dvr[c] += prob * gr[c];                         \
                if (dk) {                                                                               \
                    T dd = gq ? gq[matrix(p.aq, i, p.heads) + r * p.aq.row] : row_d<T>(p, vis, g, ag, lse, i, r); \
                    T ds = prob * (dot<T>(gr, vj, p.dv) - dd) * p.scale;                                \
                    for (i64 c = 0; c < p.d; ++c) dk[c] += ds * qr[c];                                  \
                }                                                                                       \
            }                                                                                           \
        }                                                                                               \
    }                                                                                                   \
    /* dq of every query row, its D read from the row's first element before the row is written. */  \
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
                T prob = exp(p.scale * dot<T>(qr, kj, p.d) - l);                                        \
                T ds = prob * (dot<T>(gr, p.vrow(i, j), p.dv) - dd) * p.scale;                          \
                for (i64 c = 0; c < p.d; ++c) dq[c] += ds * kj[c];                                      \
            }                                                                                           \
        }                                                                                               \
    }

ATTENTION(float, f32)
ATTENTION(double, f64)

// ----- Tiled, f32 ---------------------------------------------------------------------------------
// Shared tiles are [rows][D + 1] (the pad keeps the rows of a tile in different banks); a thread's
// results are the columns lane, lane + 32, ... (< D) of the rows warp, warp + 4, ... of its block's
// tile. Rows past the end and columns past the head size are staged as zeros and never written.

#define TILE_THREADS 128
#define TILE_WARPS (TILE_THREADS / 32)

// Rows r0 .. r0 + ROWS of a matrix (`rows` of them, `cols` values each, row r at m + r * stride)
// into `sh`.
template <int D, int ROWS>
__device__ void stage_rows(float* sh, const float* m, i64 stride, i64 r0, i64 rows, i64 cols) {
    for (int e = threadIdx.x; e < ROWS * D; e += TILE_THREADS) {
        int a = e / D, c = e % D;
        sh[a * (D + 1) + c] = (r0 + a < rows && c < cols) ? m[(r0 + a) * stride + c] : 0.0f;
    }
}

template <int D>
__device__ __forceinline__ float tile_dot(const float* a, const float* b, i64 n) {
    float s = 0.0f;
    for (i64 c = 0; c < n; ++c) s += a[c] * b[c];
    return s;
}

// The forward of one tile of BR query rows: out and lse of rows r0 .. r0 + BR of matrix i.
template <int D, int BR, int BC>
__device__ void attention_tile(const Problem<float>& p, const Visible& vis, float* out, const Addr& ao, float* lse, i64 i, i64 r0) {
    __shared__ float qs[BR * (D + 1)], ks[BC * (D + 1)], vs[BC * (D + 1)], s[BR * (BC + 1)];
    __shared__ float m_row[BR], l_row[BR], alpha_row[BR];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    float acc[BR / TILE_WARPS][D / 32];
    for (int k = 0; k < BR / TILE_WARPS; ++k)
        for (int u = 0; u < D / 32; ++u) acc[k][u] = 0.0f;
    stage_rows<D, BR>(qs, p.q + matrix(p.aq, i, p.heads), p.aq.row, r0, p.tq, p.d);
    if (threadIdx.x < BR) { m_row[threadIdx.x] = -INFINITY; l_row[threadIdx.x] = 0.0f; }
    i64 kend = vis.causal ? min(p.tk, r0 + BR) : p.tk;
    for (i64 j0 = 0; j0 < kend; j0 += BC) {
        __syncthreads();
        stage_rows<D, BC>(ks, p.k + matrix(p.ak, i, p.heads), p.ak.row, j0, p.tk, p.d);
        stage_rows<D, BC>(vs, p.v + matrix(p.av, i, p.heads), p.av.row, j0, p.tk, p.dv);
        __syncthreads();
        for (int e = threadIdx.x; e < BR * BC; e += TILE_THREADS) {
            int a = e / BC, b = e % BC;
            i64 r = r0 + a, j = j0 + b;
            bool seen = r < p.tq && j < p.tk && !vis.hidden(i, r, j);
            s[a * (BC + 1) + b] = seen ? p.scale * tile_dot<D>(qs + a * (D + 1), ks + b * (D + 1), p.d) : -INFINITY;
        }
        __syncthreads();
        if (threadIdx.x < BR) {
            int a = threadIdx.x;
            float* row = s + a * (BC + 1);
            float m = m_row[a];
            for (int b = 0; b < BC; ++b) m = fmaxf(m, row[b]);
            float alpha = 1.0f, sum = 0.0f;
            if (m != -INFINITY) {
                alpha = expf(m_row[a] - m);
                for (int b = 0; b < BC; ++b) { row[b] = expf(row[b] - m); sum += row[b]; }
                m_row[a] = m;
            } else {
                for (int b = 0; b < BC; ++b) row[b] = 0.0f;
            }
            l_row[a] = l_row[a] * alpha + sum;
            alpha_row[a] = alpha;
        }
        __syncthreads();
        for (int k = 0; k < BR / TILE_WARPS; ++k) {
            int a = warp + TILE_WARPS * k;
            const float* pr = s + a * (BC + 1);
            for (int u = 0; u < D / 32; ++u) {
                int c = lane + 32 * u;
                float o = acc[k][u] * alpha_row[a];
                for (int b = 0; b < BC; ++b) o += pr[b] * vs[b * (D + 1) + c];
                acc[k][u] = o;
            }
        }
    }
    __syncthreads();
    for (int k = 0; k < BR / TILE_WARPS; ++k) {
        int a = warp + TILE_WARPS * k;
        i64 r = r0 + a;
        if (r >= p.tq) continue;
        float l = l_row[a];
        float* o = out + matrix(ao, i, p.heads) + r * ao.row;
        for (int u = 0; u < D / 32; ++u) {
            int c = lane + 32 * u;
            if (c < p.dv) o[c] = l > 0.0f ? acc[k][u] / l : 0.0f;
        }
    }
    if (lse && threadIdx.x < BR && r0 + threadIdx.x < p.tq) {
        int a = threadIdx.x;
        lse[i * p.tq + r0 + a] = l_row[a] > 0.0f ? m_row[a] + logf(l_row[a]) : -INFINITY;
    }
    __syncthreads();
}

// The backward over one tile of BR query rows. pass 0: D of each row (sum over keys of P dP) into
// the first element of its dq row; pass 1: dq of each row, its D read from there first.
template <int D, int BR, int BC>
__device__ void attention_backward_q_tile(const Problem<float>& p, const Visible& vis, const float* g, const Addr& ag, const float* lse,
                                          float* gq, int pass, i64 i, i64 r0) {
    __shared__ float qs[BR * (D + 1)], gs[BR * (D + 1)], ks[BC * (D + 1)], vs[BC * (D + 1)], s[BR * (BC + 1)];
    __shared__ float l_row[BR], d_row[BR];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    float acc[BR / TILE_WARPS][D / 32];
    for (int k = 0; k < BR / TILE_WARPS; ++k)
        for (int u = 0; u < D / 32; ++u) acc[k][u] = 0.0f;
    float* gq0 = gq + matrix(p.aq, i, p.heads);
    stage_rows<D, BR>(qs, p.q + matrix(p.aq, i, p.heads), p.aq.row, r0, p.tq, p.d);
    stage_rows<D, BR>(gs, g + matrix(ag, i, p.heads), ag.row, r0, p.tq, p.dv);
    if (threadIdx.x < BR) {
        i64 r = r0 + threadIdx.x;
        l_row[threadIdx.x] = r < p.tq ? lse[i * p.tq + r] : 0.0f;
        d_row[threadIdx.x] = (pass == 1 && r < p.tq) ? gq0[r * p.aq.row] : 0.0f;
    }
    i64 kend = vis.causal ? min(p.tk, r0 + BR) : p.tk;
    for (i64 j0 = 0; j0 < kend; j0 += BC) {
        __syncthreads();
        stage_rows<D, BC>(ks, p.k + matrix(p.ak, i, p.heads), p.ak.row, j0, p.tk, p.d);
        stage_rows<D, BC>(vs, p.v + matrix(p.av, i, p.heads), p.av.row, j0, p.tk, p.dv);
        __syncthreads();
        for (int e = threadIdx.x; e < BR * BC; e += TILE_THREADS) {
            int a = e / BC, b = e % BC;
            i64 r = r0 + a, j = j0 + b;
            float v = 0.0f;
            if (r < p.tq && j < p.tk && !vis.hidden(i, r, j)) {
                float prob = expf(p.scale * tile_dot<D>(qs + a * (D + 1), ks + b * (D + 1), p.d) - l_row[a]);
                float dp = tile_dot<D>(gs + a * (D + 1), vs + b * (D + 1), p.dv);
                v = pass == 0 ? prob * dp : prob * (dp - d_row[a]) * p.scale;
            }
            s[a * (BC + 1) + b] = v;
        }
        __syncthreads();
        if (pass == 0) {
            if (threadIdx.x < BR)
                for (int b = 0; b < BC; ++b) d_row[threadIdx.x] += s[threadIdx.x * (BC + 1) + b];
        } else {
            for (int k = 0; k < BR / TILE_WARPS; ++k) {
                int a = warp + TILE_WARPS * k;
                const float* dsr = s + a * (BC + 1);
                for (int u = 0; u < D / 32; ++u) {
                    int c = lane + 32 * u;
                    float x = acc[k][u];
                    for (int b = 0; b < BC; ++b) x += dsr[b] * ks[b * (D + 1) + c];
                    acc[k][u] = x;
                }
            }
        }
    }
    __syncthreads();
    if (pass == 0) {
        if (threadIdx.x < BR && r0 + threadIdx.x < p.tq) gq0[(r0 + threadIdx.x) * p.aq.row] = d_row[threadIdx.x];
    } else {
        for (int k = 0; k < BR / TILE_WARPS; ++k) {
            i64 r = r0 + warp + TILE_WARPS * k;
            if (r >= p.tq) continue;
            for (int u = 0; u < D / 32; ++u) {
                int c = lane + 32 * u;
                if (c < p.d) gq0[r * p.aq.row + c] = acc[k][u];
            }
        }
    }
    __syncthreads();
}

// dk and dv of one tile of BC key rows, from every query row that sees them (D from dq's rows).
template <int D, int BR, int BC>
__device__ void attention_backward_kv_tile(const Problem<float>& p, const Visible& vis, const float* g, const Addr& ag, const float* lse,
                                           const float* gq, float* gk, float* gv, i64 i, i64 j0) {
    __shared__ float ks[BC * (D + 1)], vs[BC * (D + 1)], qs[BR * (D + 1)], gs[BR * (D + 1)];
    __shared__ float ps[BR * (BC + 1)], ds[BR * (BC + 1)], l_row[BR], d_row[BR];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    float dk[BC / TILE_WARPS][D / 32], dv[BC / TILE_WARPS][D / 32];
    for (int k = 0; k < BC / TILE_WARPS; ++k)
        for (int u = 0; u < D / 32; ++u) { dk[k][u] = 0.0f; dv[k][u] = 0.0f; }
    const float* gq0 = gq + matrix(p.aq, i, p.heads);
    stage_rows<D, BC>(ks, p.k + matrix(p.ak, i, p.heads), p.ak.row, j0, p.tk, p.d);
    stage_rows<D, BC>(vs, p.v + matrix(p.av, i, p.heads), p.av.row, j0, p.tk, p.dv);
    i64 rstart = vis.causal ? (j0 / BR) * BR : 0;
    for (i64 r0 = rstart; r0 < p.tq; r0 += BR) {
        __syncthreads();
        stage_rows<D, BR>(qs, p.q + matrix(p.aq, i, p.heads), p.aq.row, r0, p.tq, p.d);
        stage_rows<D, BR>(gs, g + matrix(ag, i, p.heads), ag.row, r0, p.tq, p.dv);
        if (threadIdx.x < BR) {
            i64 r = r0 + threadIdx.x;
            l_row[threadIdx.x] = r < p.tq ? lse[i * p.tq + r] : 0.0f;
            d_row[threadIdx.x] = r < p.tq ? gq0[r * p.aq.row] : 0.0f;
        }
        __syncthreads();
        for (int e = threadIdx.x; e < BR * BC; e += TILE_THREADS) {
            int a = e / BC, b = e % BC;
            i64 r = r0 + a, j = j0 + b;
            float prob = 0.0f, dsv = 0.0f;
            if (r < p.tq && j < p.tk && !vis.hidden(i, r, j)) {
                prob = expf(p.scale * tile_dot<D>(qs + a * (D + 1), ks + b * (D + 1), p.d) - l_row[a]);
                float dp = tile_dot<D>(gs + a * (D + 1), vs + b * (D + 1), p.dv);
                dsv = prob * (dp - d_row[a]) * p.scale;
            }
            ps[a * (BC + 1) + b] = prob;
            ds[a * (BC + 1) + b] = dsv;
        }
        __syncthreads();
        for (int k = 0; k < BC / TILE_WARPS; ++k) {
            int b = warp + TILE_WARPS * k;
            for (int u = 0; u < D / 32; ++u) {
                int c = lane + 32 * u;
                float xv = dv[k][u], xk = dk[k][u];
                for (int a = 0; a < BR; ++a) {
                    xv += ps[a * (BC + 1) + b] * gs[a * (D + 1) + c];
                    xk += ds[a * (BC + 1) + b] * qs[a * (D + 1) + c];
                }
                dv[k][u] = xv;
                dk[k][u] = xk;
            }
        }
    }
    __syncthreads();
    for (int k = 0; k < BC / TILE_WARPS; ++k) {
        i64 j = j0 + warp + TILE_WARPS * k;
        if (j >= p.tk) continue;
        for (int u = 0; u < D / 32; ++u) {
            int c = lane + 32 * u;
            if (gk && c < p.d) gk[matrix(p.ak, i, p.heads) + j * p.ak.row + c] = dk[k][u];
            if (gv && c < p.dv) gv[matrix(p.av, i, p.heads) + j * p.av.row + c] = dv[k][u];
        }
    }
    __syncthreads();
}

// The entry points for head sizes up to D: blocks walk the (matrix, tile) pairs, so a block's
// threads always agree on their tile (the barriers inside need that). Query tiles of BR rows meet
// key tiles of BC rows (forward, D and dq); key tiles of KC rows meet query tiles of KR (dk, dv).
#define ATTENTION_TILED(D, BR, BC, KC, KR)                                                                      \
    extern "C" __global__ void attention_tiled_d##D##_f32(Problem<float> p, Visible vis, float* out, Addr ao, float* lse) { \
        i64 tiles = (p.tq + BR - 1) / BR;                                                               \
        for (i64 t = blockIdx.x; t < p.bh * tiles; t += gridDim.x)                                      \
            attention_tile<D, BR, BC>(p, vis, out, ao, lse, t / tiles, (t % tiles) * BR);                \
    }                                                                                                   \
    extern "C" __global__ void attention_tiled_backward_q_d##D##_f32(Problem<float> p, Visible vis, const float* g, Addr ag, const float* lse, float* gq, int pass) { \
        i64 tiles = (p.tq + BR - 1) / BR;                                                               \
        for (i64 t = blockIdx.x; t < p.bh * tiles; t += gridDim.x)                                      \
            attention_backward_q_tile<D, BR, BC>(p, vis, g, ag, lse, gq, pass, t / tiles, (t % tiles) * BR); \
    }                                                                                                   \
    extern "C" __global__ void attention_tiled_backward_kv_d##D##_f32(Problem<float> p, Visible vis, const float* g, Addr ag, const float* lse, const float* gq, float* gk, float* gv) { \
        i64 tiles = (p.tk + KC - 1) / KC;                                                               \
        for (i64 t = blockIdx.x; t < p.bh * tiles; t += gridDim.x)                                      \
            attention_backward_kv_tile<D, KR, KC>(p, vis, g, ag, lse, gq, gk, gv, t / tiles, (t % tiles) * KC); \
    }

ATTENTION_TILED(64, 32, 16, 32, 16)
ATTENTION_TILED(128, 16, 16, 16, 16)
