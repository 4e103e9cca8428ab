// Embedding lookup and its backward. An index outside the table sets `*bad` to the first offending
// position + 1 (read by the host at the step's synchronisation) instead of reading out of bounds.
//
// Note [Embedding backward on a GPU]: deterministic and O(positions x d), not O(rows x positions x d)
// (a GPT-2 table has 50,304 rows). The positions are sorted by the row they name, in position order
// within a row, by a stable radix sort (8 bits of the row a pass; a row of text names tens of
// thousands of positions, so no per-row sort); each row's range comes from a count per row and a
// prefix sum. The op's int64 workspace is [starts: rows + 1][slots: positions][spare: positions]
// [digit counts: 1 + 256 x tiles] (`embedding_workspace_len` in memfit-tensor). Then one thread per (row,
// column) adds its positions' gradients in position order, the order the cpu adds them in, so both
// give the same bits.

/* starts[r + 1] = how many positions name row r (starts zeroed before). */
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

/* Positions per tile of the radix sort, and threads per block of its two kernels (memfit-tensor's
   EMBEDDING_SORT_TILE). */
#define SORT_TILE 256

/* The 8 bits from `shift` of the row position `i` of the pass's input names (`in`, or position i
   itself in the first pass); an index outside the table sorts after every row, `rows`, so it
   falls in no row's range. */
__device__ __forceinline__ int sort_digit(const i64* idx, i64 rows, const i64* in, i64 i, int shift, i64* position) {
    i64 p = in ? in[i] : i;
    i64 r = idx[p];
    *position = p;
    return (int)(((r >= 0 && r < rows ? r : rows) >> shift) & 255);
}

/* A pass of the stable radix sort, first half: tile t's count of each digit d into
   hist[1 + d * tiles + t] (digit-major, so a prefix sum over hist gives each tile's first slot
   for each digit). A block of SORT_TILE threads per tile. */
extern "C" __global__ void embedding_digits(const i64* idx, i64 count, i64 rows, const i64* in, int shift, i64 tiles, i64* hist) {
    __shared__ unsigned counts[256];
    counts[threadIdx.x] = 0;
    __syncthreads();
    i64 i = (i64)blockIdx.x * SORT_TILE + threadIdx.x, p;
    if (i < count) atomicAdd(&counts[sort_digit(idx, rows, in, i, shift, &p)], 1u);
    __syncthreads();
    hist[1 + (i64)threadIdx.x * tiles + blockIdx.x] = counts[threadIdx.x];
}

/* Second half: each position of tile t to out[where its digit's slots begin for t (hist, prefix
   summed) + how many of the tile's earlier positions have its digit], so equal digits keep their
   order: the pass is stable. */
extern "C" __global__ void embedding_scatter(const i64* idx, i64 count, i64 rows, const i64* in, int shift, i64 tiles, const i64* hist, i64* out) {
    __shared__ short digits[SORT_TILE];
    i64 i = (i64)blockIdx.x * SORT_TILE + threadIdx.x, p = 0;
    int digit = i < count ? sort_digit(idx, rows, in, i, shift, &p) : -1;
    digits[threadIdx.x] = (short)digit;
    __syncthreads();
    if (i >= count) return;
    i64 rank = 0;
    for (unsigned j = 0; j < threadIdx.x; ++j) rank += digits[j] == digit;
    out[hist[(i64)digit * tiles + blockIdx.x] + rank] = p;
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
