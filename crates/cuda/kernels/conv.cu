// 2-D convolution's data movement around cuBLAS: im2col (a tile of output rows r0..r1 of one
// sample: col[(c, ki, kj), (oh - r0) * ow + ow_] = x[c, oh*sh + ki*dh - ph, ow_*sw + kj*dw - pw], 0
// in the padding) and col2im (the tile added back onto the input gradient: one thread per input
// element gathers every tap that read it, in order, so no atomics and the same bits every run).
// Both take `lanes` samples at once: lane l's sample is `x_lane` elements after lane 0's (and its
// input gradient likewise), its tile `col_lane` elements after lane 0's.

struct Conv {
    i64 c, h, w, kh, kw, sh, sw, ph, pw, dh, dw, ow, r0, r1, lanes, x_lane, col_lane;
};

#define CONV(T, SUF)                                                                                    \
    extern "C" __global__ void im2col_##SUF(const T* x, Conv g, T* col) {                              \
        i64 tp = (g.r1 - g.r0) * g.ow, tile = g.c * g.kh * g.kw * tp;                                   \
        GRID_STRIDE(k, g.lanes * tile) {                                                                \
            i64 lane = k / tile, rest = k % tile;                                                       \
            i64 row = rest / tp, t = rest % tp;                                                         \
            i64 ci = row / (g.kh * g.kw), ki = (row / g.kw) % g.kh, kj = row % g.kw;                    \
            i64 ih = (g.r0 + t / g.ow) * g.sh + ki * g.dh - g.ph;                                       \
            i64 iw = (t % g.ow) * g.sw + kj * g.dw - g.pw;                                              \
            const T* xl = x + lane * g.x_lane;                                                          \
            col[lane * g.col_lane + rest] =                                                             \
                (ih >= 0 && ih < g.h && iw >= 0 && iw < g.w) ? xl[(ci * g.h + ih) * g.w + iw] : T(0);   \
        }                                                                                               \
    }                                                                                                   \
    extern "C" __global__ void col2im_##SUF(const T* col, Conv g, T* dx) {                             \
        i64 tp = (g.r1 - g.r0) * g.ow, plane = g.c * g.h * g.w;                                         \
        GRID_STRIDE(k, g.lanes * plane) {                                                               \
            i64 lane = k / plane, rest = k % plane;                                                     \
            i64 ci = rest / (g.h * g.w), ih = (rest / g.w) % g.h, iw = rest % g.w;                      \
            const T* cl = col + lane * g.col_lane;                                                      \
            T acc = T(0);                                                                               \
            for (i64 ki = 0; ki < g.kh; ++ki) {                                                         \
                i64 th = ih + g.ph - ki * g.dh;                                                         \
                if (th < 0 || th % g.sh != 0) continue;                                                 \
                i64 orow = th / g.sh;                                                                   \
                if (orow < g.r0 || orow >= g.r1) continue;                                              \
                for (i64 kj = 0; kj < g.kw; ++kj) {                                                     \
                    i64 tw = iw + g.pw - kj * g.dw;                                                     \
                    if (tw < 0 || tw % g.sw != 0) continue;                                             \
                    i64 ocol = tw / g.sw;                                                               \
                    if (ocol >= g.ow) continue;                                                         \
                    acc += cl[((ci * g.kh + ki) * g.kw + kj) * tp + (orow - g.r0) * g.ow + ocol];       \
                }                                                                                       \
            }                                                                                           \
            dx[lane * g.x_lane + rest] += acc;                                                          \
        }                                                                                               \
    }

CONV(float, f32)
CONV(double, f64)
