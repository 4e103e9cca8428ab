// Embedding lookup and its backward. An index outside the table sets `*bad` to the first offending
// position + 1 (read by the host at the step's synchronisation) instead of reading out of bounds.
//
// Note [Embedding backward on a GPU]: deterministic and O(positions x d), not O(rows x positions x d)
// (a GPT-2 table has 50,304 rows). The positions are sorted by the row they name, in position order
// within a row (a counting sort: count per row, prefix sum, place, then sort each row's few
// positions), in the op's int64 workspace [starts: rows + 1][cursor: rows][slots: positions]; then one
// thread per (row, column) adds its positions' gradients in position order, the order the cpu adds
// them in, so both give the same bits.

/* starts[r + 1] = how many positions name row r (starts and cursor zeroed before). */
extern "C" __global__ void embedding_count(const i64* idx, i64 count, i64 rows, u64* starts) {
    GRID_STRIDE(p, count) {
        i64 r = idx[p];
        if (r >= 0 && r < rows) atomicAdd(starts + r + 1, 1ULL);
    }
}

/* starts[i] = the sum of starts[0..=i] (one block: a chunk per thread, the chunks' sums scanned by
   thread 0), so starts[r] is where row r's positions begin. */
extern "C" __global__ void embedding_scan(i64* starts, i64 n) {
    __shared__ i64 shared[1024];
    i64 chunk = (n + blockDim.x - 1) / blockDim.x;
    i64 lo = threadIdx.x * chunk, hi = lo + chunk < n ? lo + chunk : n;
    i64 sum = 0;
    for (i64 i = lo; i < hi; ++i) sum += starts[i];
    shared[threadIdx.x] = sum;
    __syncthreads();
    if (threadIdx.x == 0) {
        i64 acc = 0;
        for (unsigned t = 0; t < blockDim.x; ++t) { i64 v = shared[t]; shared[t] = acc; acc += v; }
    }
    __syncthreads();
    i64 acc = shared[threadIdx.x];
    for (i64 i = lo; i < hi; ++i) { acc += starts[i]; starts[i] = acc; }
}

/* Each position into a slot of its row's range (in no particular order within the row). */
extern "C" __global__ void embedding_place(const i64* idx, i64 count, i64 rows, const i64* starts, u64* cursor, i64* slots) {
    GRID_STRIDE(p, count) {
        i64 r = idx[p];
        if (r >= 0 && r < rows) slots[starts[r] + (i64)atomicAdd(cursor + r, 1ULL)] = p;
    }
}

/* Each row's positions in ascending order (insertion sort: a row names few positions). */
extern "C" __global__ void embedding_sort(const i64* starts, i64 rows, i64* slots) {
    GRID_STRIDE(r, rows) {
        for (i64 i = starts[r] + 1; i < starts[r + 1]; ++i) {
            i64 v = slots[i], j = i;
            while (j > starts[r] && slots[j - 1] > v) { slots[j] = slots[j - 1]; --j; }
            slots[j] = v;
        }
    }
}

#define EMBEDDING(T, SUF)                                                                               \
    extern "C" __global__ void embedding_##SUF(const i64* idx, i64 count, const T* w, i64 rows, i64 d, T* out, i64* bad) { \
        GRID_STRIDE(k, count * d) {                                                                     \
            i64 pos = k / d, col = k % d, row = idx[pos];                                               \
            if (row < 0 || row >= rows) { atomicCAS((u64*)bad, 0ULL, (u64)(pos + 1)); out[k] = T(0); }  \
            else out[k] = w[row * d + col];                                                             \
        }                                                                                               \
    }                                                                                                   \
    /* gw[row, col] += the gradients of row's positions, in position order (see the Note). */        \
    extern "C" __global__ void embedding_backward_##SUF(const i64* starts, const i64* slots, const T* g, i64 rows, i64 d, T* gw) { \
        GRID_STRIDE(k, rows * d) {                                                                      \
            i64 row = k / d, col = k % d;                                                               \
            T acc = gw[k];                                                                              \
            for (i64 s = starts[row]; s < starts[row + 1]; ++s) acc += g[slots[s] * d + col];           \
            gw[k] = acc;                                                                                \
        }                                                                                               \
    }

EMBEDDING(float, f32)
EMBEDDING(double, f64)
