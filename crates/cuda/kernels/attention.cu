// Scaled dot-product attention, forward and backward, one thread per query row (forward, and the
// backward's D and dq) or per key row (the backward's dk and dv): each thread walks its row in
// order, so results repeat bit for bit and no scratch memory is needed (O(T) memory, as the cpu
// path: only the per-row log-sum-exp is saved). Correct, not fast: fused tiles are issue 32.
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
