// Dropout with memfit's counter-based draw (SplitMix64 of the seed and the element's index, as the
// cpu kernel), so the same seed gives the same mask on every device. One thread per mask byte.

#define GAMMA 0x9E3779B97F4A7C15ULL

__device__ __forceinline__ u64 mix(u64 z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

__device__ __forceinline__ double uniform(u64 key, u64 i) {
    u64 z = mix(key + (i + 1) * GAMMA);
    return (double)(z >> 11) * (1.0 / 9007199254740992.0);
}

#define DROPOUT(T, SUF)                                                                                 \
    extern "C" __global__ void dropout_##SUF(const T* x, double p, u64 key, T scale, T* out, unsigned char* mask, i64 n) { \
        GRID_STRIDE(byte, (n + 7) / 8) {                                                                \
            unsigned char bits = 0;                                                                     \
            for (int j = 0; j < 8; ++j) {                                                               \
                i64 i = byte * 8 + j;                                                                   \
                if (i >= n) break;                                                                      \
                bool keep = uniform(key, (u64)i) >= p;                                                  \
                out[i] = keep ? x[i] * scale : T(0);                                                    \
                bits |= (unsigned char)keep << j;                                                       \
            }                                                                                           \
            if (mask) mask[byte] = bits;                                                                \
        }                                                                                               \
    }                                                                                                   \
    extern "C" __global__ void dropout_backward_##SUF(const T* g, const unsigned char* mask, T scale, T* gx, i64 n) { \
        GRID_STRIDE(i, n) gx[i] = ((mask[i / 8] >> (i % 8)) & 1) ? g[i] * scale : T(0);                \
    }

DROPOUT(float, f32)
DROPOUT(double, f64)
