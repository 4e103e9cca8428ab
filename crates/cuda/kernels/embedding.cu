// Embedding lookup and its backward. An index outside the table sets `*bad` to the first offending
// position + 1 (read by the host at the step's synchronisation) instead of reading out of bounds.
// The backward is deterministic: one thread per (table row, column) adds, in index order, the
// gradients of the positions that name its row.

#define EMBEDDING(T, SUF)                                                                               \
    extern "C" __global__ void embedding_##SUF(const i64* idx, i64 count, const T* w, i64 rows, i64 d, T* out, i64* bad) { \
        GRID_STRIDE(k, count * d) {                                                                     \
            i64 pos = k / d, col = k % d, row = idx[pos];                                               \
            if (row < 0 || row >= rows) { atomicCAS((u64*)bad, 0ULL, (u64)(pos + 1)); out[k] = T(0); }  \
            else out[k] = w[row * d + col];                                                             \
        }                                                                                               \
    }                                                                                                   \
    extern "C" __global__ void embedding_backward_##SUF(const i64* idx, i64 count, const T* g, i64 rows, i64 d, T* gw) { \
        GRID_STRIDE(k, rows * d) {                                                                      \
            i64 row = k / d, col = k % d;                                                               \
            T acc = gw[k];                                                                              \
            for (i64 pos = 0; pos < count; ++pos)                                                       \
                if (idx[pos] == row) acc += g[pos * d + col];                                           \
            gw[k] = acc;                                                                                \
        }                                                                                               \
    }

EMBEDDING(float, f32)
EMBEDDING(double, f64)
