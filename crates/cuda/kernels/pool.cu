// Max and average pooling over planes [planes, h, w] -> [planes, oh, ow], as the cpu kernels:
// max takes a strictly larger value or a NaN (PyTorch's rule) and saves the winning window
// position (`width` bytes, little-endian) and optionally the flat input index; average windows
// are fixed (with or without the padding counted) or adaptive. Forward: one thread per output;
// backward: one thread per plane, outputs in order (deterministic, no atomics).

struct Pool {
    i64 planes, h, w, oh, ow, kh, kw, sh, sw, ph, pw, dh, dw;
};

// Avg kinds: 0 fixed counting the padding, 1 fixed without it, 2 adaptive.
struct Window {
    i64 h0, h1, w0, w1, divisor;
};

__device__ void window_1d(i64 o, i64 k, i64 s, i64 p, i64 size, i64* lo, i64* hi, i64* span) {
    i64 start = o * s - p;
    i64 end = min(start + k, size + p);
    *span = max(end - start, (i64)0);
    *lo = max(start, (i64)0);
    *hi = max(min(max(end, (i64)0), size), *lo);
}

__device__ Window avg_window(const Pool& g, int kind, i64 oh, i64 ow) {
    Window win;
    if (kind == 2) {
        win.h0 = oh * g.h / g.oh;
        win.h1 = ((oh + 1) * g.h + g.oh - 1) / g.oh;
        win.w0 = ow * g.w / g.ow;
        win.w1 = ((ow + 1) * g.w + g.ow - 1) / g.ow;
        win.divisor = (win.h1 - win.h0) * (win.w1 - win.w0);
    } else {
        i64 sh, sw;
        window_1d(oh, g.kh, g.sh, g.ph, g.h, &win.h0, &win.h1, &sh);
        window_1d(ow, g.kw, g.sw, g.pw, g.w, &win.w0, &win.w1, &sw);
        win.divisor = kind == 0 ? sh * sw : (win.h1 - win.h0) * (win.w1 - win.w0);
    }
    return win;
}

#define POOL(T, SUF)                                                                                    \
    extern "C" __global__ void max_pool2d_##SUF(const T* x, Pool g, T* out, i64* indices, unsigned char* positions, int width) { \
        GRID_STRIDE(e, g.planes * g.oh * g.ow) {                                                        \
            i64 plane = e / (g.oh * g.ow), oh = (e / g.ow) % g.oh, ow = e % g.ow;                       \
            i64 hs = oh * g.sh - g.ph, ws = ow * g.sw - g.pw;                                           \
            const T* src = x + plane * g.h * g.w;                                                       \
            i64 ilo = 0, jlo = 0;                                                                       \
            while (ilo < g.kh && hs + ilo * g.dh < 0) ++ilo;                                            \
            while (jlo < g.kw && ws + jlo * g.dw < 0) ++jlo;                                            \
            T best = -INFINITY;                                                                         \
            i64 bi = ilo, bj = jlo;                                                                     \
            for (i64 i = ilo; i < g.kh; ++i) {                                                          \
                i64 ih = hs + i * g.dh;                                                                 \
                if (ih >= g.h) break;                                                                   \
                for (i64 j = jlo; j < g.kw; ++j) {                                                      \
                    i64 iw = ws + j * g.dw;                                                             \
                    if (iw >= g.w) break;                                                               \
                    T v = src[ih * g.w + iw];                                                           \
                    if (v > best || v != v) { best = v; bi = i; bj = j; }                               \
                }                                                                                       \
            }                                                                                           \
            out[e] = best;                                                                              \
            if (indices) indices[e] = (hs + bi * g.dh) * g.w + (ws + bj * g.dw);                        \
            if (positions) {                                                                            \
                unsigned at = (unsigned)(bi * g.kw + bj);                                               \
                for (int b = 0; b < width; ++b) positions[e * width + b] = (unsigned char)(at >> (8 * b)); \
            }                                                                                           \
        }                                                                                               \
    }                                                                                                   \
    extern "C" __global__ void max_pool2d_backward_##SUF(const T* g_out, const unsigned char* positions, int width, Pool g, T* dx) { \
        GRID_STRIDE(plane, g.planes) {                                                                  \
            T* d = dx + plane * g.h * g.w;                                                              \
            for (i64 k = 0; k < g.h * g.w; ++k) d[k] = T(0);                                            \
            for (i64 oh = 0; oh < g.oh; ++oh)                                                           \
                for (i64 ow = 0; ow < g.ow; ++ow) {                                                     \
                    i64 e = (plane * g.oh + oh) * g.ow + ow;                                            \
                    unsigned at = 0;                                                                    \
                    for (int b = 0; b < width; ++b) at |= (unsigned)positions[e * width + b] << (8 * b); \
                    if (at >= (unsigned)(g.kh * g.kw)) continue;                                        \
                    i64 ih = oh * g.sh - g.ph + (at / g.kw) * g.dh;                                     \
                    i64 iw = ow * g.sw - g.pw + (at % g.kw) * g.dw;                                     \
                    if (ih >= 0 && iw >= 0 && ih < g.h && iw < g.w) d[ih * g.w + iw] += g_out[e];       \
                }                                                                                       \
        }                                                                                               \
    }                                                                                                   \
    extern "C" __global__ void avg_pool2d_##SUF(const T* x, Pool g, int kind, T* out) {                \
        GRID_STRIDE(e, g.planes * g.oh * g.ow) {                                                        \
            i64 plane = e / (g.oh * g.ow), oh = (e / g.ow) % g.oh, ow = e % g.ow;                       \
            Window win = avg_window(g, kind, oh, ow);                                                   \
            const T* src = x + plane * g.h * g.w;                                                       \
            T sum = T(0);                                                                               \
            for (i64 ih = win.h0; ih < win.h1; ++ih)                                                    \
                for (i64 iw = win.w0; iw < win.w1; ++iw) sum += src[ih * g.w + iw];                     \
            out[e] = (win.h0 < win.h1 && win.w0 < win.w1 && win.divisor > 0) ? sum / T(win.divisor) : T(0); \
        }                                                                                               \
    }                                                                                                   \
    extern "C" __global__ void avg_pool2d_backward_##SUF(const T* g_out, Pool g, int kind, T* dx) {    \
        GRID_STRIDE(plane, g.planes) {                                                                  \
            T* d = dx + plane * g.h * g.w;                                                              \
            for (i64 k = 0; k < g.h * g.w; ++k) d[k] = T(0);                                            \
            for (i64 oh = 0; oh < g.oh; ++oh)                                                           \
                for (i64 ow = 0; ow < g.ow; ++ow) {                                                     \
                    Window win = avg_window(g, kind, oh, ow);                                           \
                    if (win.divisor == 0) continue;                                                     \
                    T share = g_out[(plane * g.oh + oh) * g.ow + ow] / T(win.divisor);                  \
                    for (i64 ih = win.h0; ih < win.h1; ++ih)                                            \
                        for (i64 iw = win.w0; iw < win.w1; ++iw) d[ih * g.w + iw] += share;             \
                }                                                                                       \
        }                                                                                               \
    }

POOL(float, f32)
POOL(double, f64)
