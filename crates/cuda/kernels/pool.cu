// Max and average pooling over planes [planes, h, w] -> [planes, oh, ow], as the cpu kernels:
// max takes a strictly larger value or a NaN (PyTorch's rule) and saves the winning window
// position (`width` bytes, little-endian) and optionally the flat input index; average windows
// are fixed (with or without the padding counted) or adaptive. Forward: one thread per output;
// backward: one thread per input element, adding the outputs that read it in output order (the
// order a plane's outputs were added in before: the same bits, no atomics, all elements at once).

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

// The output along one axis whose window's tap `i` reads input `in` (stride s, padding p, dilation
// d, n outputs), or -1. Taps in descending order give outputs in ascending order.
__device__ i64 tap_output(i64 in, i64 i, i64 s, i64 p, i64 d, i64 n) {
    i64 t = in + p - i * d;
    if (t < 0 || t % s != 0 || t / s >= n) return -1;
    return t / s;
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
    /* One thread per input element gathers the outputs whose winner it was, in output order. */    \
    extern "C" __global__ void max_pool2d_backward_##SUF(const T* g_out, const unsigned char* positions, int width, Pool g, T* dx) { \
        GRID_STRIDE(k, g.planes * g.h * g.w) {                                                          \
            i64 plane = k / (g.h * g.w), ih = (k / g.w) % g.h, iw = k % g.w;                            \
            T acc = T(0);                                                                               \
            for (i64 i = g.kh - 1; i >= 0; --i) {                                                       \
                i64 oh = tap_output(ih, i, g.sh, g.ph, g.dh, g.oh);                                     \
                if (oh < 0) continue;                                                                   \
                for (i64 j = g.kw - 1; j >= 0; --j) {                                                   \
                    i64 ow = tap_output(iw, j, g.sw, g.pw, g.dw, g.ow);                                 \
                    if (ow < 0) continue;                                                               \
                    i64 e = (plane * g.oh + oh) * g.ow + ow;                                            \
                    unsigned at = 0;                                                                    \
                    for (int b = 0; b < width; ++b) at |= (unsigned)positions[e * width + b] << (8 * b); \
                    if (at == (unsigned)(i * g.kw + j)) acc += g_out[e];                                \
                }                                                                                       \
            }                                                                                           \
            dx[k] = acc;                                                                                \
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
    /* One thread per input element gathers its share of every window holding it, in output order. */ \
    extern "C" __global__ void avg_pool2d_backward_##SUF(const T* g_out, Pool g, int kind, T* dx) {    \
        GRID_STRIDE(k, g.planes * g.h * g.w) {                                                          \
            i64 plane = k / (g.h * g.w), ih = (k / g.w) % g.h, iw = k % g.w;                            \
            T acc = T(0);                                                                               \
            /* Adaptive windows have no inverse: every output is asked; fixed ones by their taps. */    \
            i64 rows = kind == 2 ? g.oh : g.kh, cols = kind == 2 ? g.ow : g.kw;                         \
            for (i64 r = 0; r < rows; ++r) {                                                            \
                i64 oh = kind == 2 ? r : tap_output(ih, g.kh - 1 - r, g.sh, g.ph, g.dh, g.oh);          \
                if (oh < 0) continue;                                                                   \
                for (i64 q = 0; q < cols; ++q) {                                                        \
                    i64 ow = kind == 2 ? q : tap_output(iw, g.kw - 1 - q, g.sw, g.pw, g.dw, g.ow);      \
                    if (ow < 0) continue;                                                               \
                    Window win = avg_window(g, kind, oh, ow);                                           \
                    if (win.divisor == 0 || ih < win.h0 || ih >= win.h1 || iw < win.w0 || iw >= win.w1) continue; \
                    acc += g_out[(plane * g.oh + oh) * g.ow + ow] / T(win.divisor);                     \
                }                                                                                       \
            }                                                                                           \
            dx[k] = acc;                                                                                \
        }                                                                                               \
    }

POOL(float, f32)
POOL(double, f64)
