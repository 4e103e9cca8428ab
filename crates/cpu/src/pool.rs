//! CPU kernels of 2-D pooling (`ops/pool.rs`): max pooling (a fast path for the plain 2x2 window,
//! flat int64 indices and the saved window positions) and its backward, and the fixed and adaptive
//! average pools and their backward, plane by plane, in parallel for large inputs.

use super::gemm::SendPtr;
use crate::dtype::Float;
use crate::error::{check_len, Result};
use crate::view::View;
use crate::with_float;
use num_traits::Zero as _;
use rayon::prelude::*;

/// The shapes of one pooling: `planes` independent [h, w] -> [oh, ow] planes.
#[derive(Clone, Copy, Debug)]
pub struct PoolGeom {
    pub planes: usize,
    pub h: usize,
    pub w: usize,
    pub oh: usize,
    pub ow: usize,
    pub kh: usize,
    pub kw: usize,
    pub sh: usize,
    pub sw: usize,
    pub ph: usize,
    pub pw: usize,
    pub dh: usize,
    pub dw: usize,
}

impl PoolGeom {
    pub fn hw(&self) -> usize {
        self.h * self.w
    }
    pub fn ohw(&self) -> usize {
        self.oh * self.ow
    }
}

/// Which average pool: a fixed window (PyTorch's `count_include_pad` divisor rule) or adaptive windows.
#[derive(Clone, Copy, Debug)]
pub enum Avg {
    Fixed { count_include_pad: bool },
    Adaptive,
}

impl Avg {
    /// The op's name.
    pub fn name(self) -> &'static str {
        match self {
            Avg::Fixed { .. } => "avg_pool2d",
            Avg::Adaptive => "adaptive_avg_pool2d",
        }
    }
}

/// Max pooling of x (contiguous planes) into `out`, with the flat `h*W + w` int64 `indices` and the
/// window `positions` (`width` little-endian bytes each) when asked for.
pub fn max_pool2d(
    g: &PoolGeom,
    x: View<'_>,
    out: View<'_>,
    indices: Option<View<'_>>,
    positions: Option<View<'_>>,
    width: usize,
) -> Result<()> {
    let (input, output) = (g.planes * g.hw(), g.planes * g.ohw());
    with_float!(x.dtype(), "max_pool2d", T => {
        let ix = match indices {
            Some(t) => Some(t.slice_mut::<i64>()?),
            None => None,
        };
        let pos = match positions {
            Some(t) => Some(t.slice_mut::<u8>()?),
            None => None,
        };
        let (xs, out) = (x.slice::<T>()?, out.slice_mut::<T>()?);
        check_len("max_pool2d input", xs.len(), input)?;
        check_len("max_pool2d output", out.len(), output)?;
        if let Some(ix) = &ix {
            check_len("max_pool2d indices", ix.len(), output)?;
        }
        if let Some(pos) = &pos {
            check_len("max_pool2d positions", pos.len(), output * width)?;
        }
        max_forward::<T>(g, xs, out, ix, pos, width);
    });
    Ok(())
}

/// The gradient of max pooling: each output's gradient goes to the input at its saved window position.
pub fn max_pool2d_backward(
    g: &PoolGeom,
    width: usize,
    grad: View<'_>,
    positions: View<'_>,
    dx: View<'_>,
) -> Result<()> {
    let (input, output) = (g.planes * g.hw(), g.planes * g.ohw());
    with_float!(grad.dtype(), "max_pool2d_backward", T => {
        let (gs, pos, dx) = (grad.slice::<T>()?, positions.slice::<u8>()?, dx.slice_mut::<T>()?);
        check_len("max_pool2d_backward output gradient", gs.len(), output)?;
        check_len("max_pool2d_backward positions", pos.len(), output * width)?;
        check_len("max_pool2d_backward input gradient", dx.len(), input)?;
        max_backward::<T>(g, width, gs, pos, dx);
    });
    Ok(())
}

/// Average pooling (fixed or adaptive windows) of x (contiguous planes) into `out`.
pub fn avg_pool2d(g: &PoolGeom, kind: Avg, x: View<'_>, out: View<'_>) -> Result<()> {
    with_float!(x.dtype(), kind.name(), T => {
        let (src, dst) = (x.slice::<T>()?, out.slice_mut::<T>()?);
        let (hw, ohw) = (g.hw(), g.ohw());
        check_len(&format!("{} input", kind.name()), src.len(), g.planes * hw)?;
        check_len(&format!("{} output", kind.name()), dst.len(), g.planes * ohw)?;
        let dp = SendPtr(dst.as_mut_ptr());
        for_planes(g.planes, ohw * avg_window_area(g, kind), |plane| {
            let dp = &dp; // capture the whole SendPtr, not its raw field
            let s = &src[plane * hw..(plane + 1) * hw];
            // SAFETY: each plane's output block is written by this task only.
            let d = unsafe { std::slice::from_raw_parts_mut(dp.0.add(plane * ohw), ohw) };
            for oh in 0..g.oh {
                for ow in 0..g.ow {
                    let win = avg_window(g, kind, oh, ow);
                    let mut sum = T::zero();
                    for ih in win.h0..win.h1 {
                        sum += s[ih * g.w + win.w0..ih * g.w + win.w1].iter().copied().sum::<T>();
                    }
                    // An empty window (impossible with the size checks) averages to 0, as in PyTorch.
                    d[oh * g.ow + ow] = if win.h0 < win.h1 && win.w0 < win.w1 && win.divisor > 0 {
                        sum / T::of(win.divisor as f64)
                    } else {
                        T::zero()
                    };
                }
            }
        });
    });
    Ok(())
}

/// The gradient of average pooling: each output's gradient shared evenly over its window.
pub fn avg_pool2d_backward(g: &PoolGeom, kind: Avg, grad: View<'_>, dx: View<'_>) -> Result<()> {
    with_float!(grad.dtype(), kind.name(), T => {
        let (gs, dx) = (grad.slice::<T>()?, dx.slice_mut::<T>()?);
        let (hw, ohw) = (g.hw(), g.ohw());
        check_len(&format!("{} backward output gradient", kind.name()), gs.len(), g.planes * ohw)?;
        check_len(&format!("{} backward input gradient", kind.name()), dx.len(), g.planes * hw)?;
        let dp = SendPtr(dx.as_mut_ptr());
        for_planes(g.planes, hw + ohw * avg_window_area(g, kind), |plane| {
            let dp = &dp; // capture the whole SendPtr, not its raw field
            // SAFETY: each plane's gradient block is written by this task only.
            let d = unsafe { std::slice::from_raw_parts_mut(dp.0.add(plane * hw), hw) };
            d.fill(T::zero());
            let gp = &gs[plane * ohw..(plane + 1) * ohw];
            for oh in 0..g.oh {
                for ow in 0..g.ow {
                    let win = avg_window(g, kind, oh, ow);
                    if win.divisor == 0 {
                        continue;
                    }
                    let share = gp[oh * g.ow + ow] / T::of(win.divisor as f64);
                    for ih in win.h0..win.h1 {
                        d[ih * g.w + win.w0..ih * g.w + win.w1].iter_mut().for_each(|v| *v += share);
                    }
                }
            }
        });
    });
    Ok(())
}

/// Runs `f(plane)` for every plane, in parallel when the total work is large.
fn for_planes(planes: usize, work_per_plane: usize, f: impl Fn(usize) + Sync + Send) {
    let work = work_per_plane.max(1);
    if planes.saturating_mul(work) >= 1 << 15 && planes > 1 {
        (0..planes).into_par_iter().with_min_len(((1 << 13) / work).max(1)).for_each(f);
    } else {
        (0..planes).for_each(f);
    }
}

/// Window taps `i` in `0..k` whose position `start + i*d` lies in `0..size`.
fn taps(start: isize, d: usize, k: usize, size: usize) -> (usize, usize) {
    let (d_i, size_i) = (d as isize, size as isize);
    let lo = if start >= 0 { 0 } else { ((-start + d_i - 1) / d_i) as usize };
    let hi = if start >= size_i { 0 } else { ((size_i - start + d_i - 1) / d_i) as usize };
    let lo = lo.min(k);
    (lo, hi.clamp(lo, k))
}

/// Window taps of every output column: (window start, first valid tap, end of valid taps).
fn column_taps(g: &PoolGeom) -> Vec<(isize, usize, usize)> {
    (0..g.ow)
        .map(|ow| {
            let ws = (ow * g.sw) as isize - g.pw as isize;
            let (lo, hi) = taps(ws, g.dw, g.kw, g.w);
            (ws, lo, hi)
        })
        .collect()
}

/// The plain 2x2 window with stride 2, no padding or dilation, every window inside the input (not
/// ceil mode's partial last one): it gets a fast path.
fn is_plain_2x2(g: &PoolGeom) -> bool {
    (g.kh, g.kw, g.sh, g.sw, g.ph, g.pw, g.dh, g.dw) == (2, 2, 2, 2, 0, 0, 1, 1) && 2 * g.oh <= g.h && 2 * g.ow <= g.w
}

/// The common training case (2x2 window, stride 2, no padding, no i64 indices asked): one pass over
/// each pair of input rows with no per-element bookkeeping beyond the one-byte position.
fn max_forward_2x2<T: Float>(g: &PoolGeom, x: &[T], out: &mut [T], positions: &mut [u8]) {
    let (hw, ohw) = (g.hw(), g.ohw());
    let op = SendPtr(out.as_mut_ptr());
    let pp = SendPtr(positions.as_mut_ptr());
    for_planes(g.planes, ohw * 4, |plane| {
        let (op, pp) = (op, pp);
        let src = &x[plane * hw..(plane + 1) * hw];
        // SAFETY: each plane's output and position blocks are written by this task only.
        let dst = unsafe { std::slice::from_raw_parts_mut(op.0.add(plane * ohw), ohw) };
        // SAFETY: as above (one byte per output).
        let pos = unsafe { std::slice::from_raw_parts_mut(pp.0.add(plane * ohw), ohw) };
        for oh in 0..g.oh {
            let r0 = &src[2 * oh * g.w..][..2 * g.ow];
            let r1 = &src[(2 * oh + 1) * g.w..][..2 * g.ow];
            let d = &mut dst[oh * g.ow..][..g.ow];
            let p = &mut pos[oh * g.ow..][..g.ow];
            for ow in 0..g.ow {
                let (a, b, c, e) = (r0[2 * ow], r0[2 * ow + 1], r1[2 * ow], r1[2 * ow + 1]);
                // Row-major order; a strictly larger value or a NaN takes over, as in PyTorch.
                let (mut best, mut at) = (a, 0u8);
                if b > best || b.is_nan() {
                    best = b;
                    at = 1;
                }
                if c > best || c.is_nan() {
                    best = c;
                    at = 2;
                }
                if e > best || e.is_nan() {
                    best = e;
                    at = 3;
                }
                d[ow] = best;
                p[ow] = at;
            }
        }
    });
}

fn max_forward<T: Float>(
    g: &PoolGeom,
    x: &[T],
    out: &mut [T],
    indices: Option<&mut [i64]>,
    positions: Option<&mut [u8]>,
    width: usize,
) {
    if indices.is_none() && width == 1 && is_plain_2x2(g) {
        if let Some(positions) = positions {
            return max_forward_2x2(g, x, out, positions);
        }
    }
    let (hw, ohw) = (g.hw(), g.ohw());
    let cols = column_taps(g);
    let plain = is_plain_2x2(g);
    let op = SendPtr(out.as_mut_ptr());
    let ip = indices.map(|s| SendPtr(s.as_mut_ptr()));
    let pp = positions.map(|s| SendPtr(s.as_mut_ptr()));
    for_planes(g.planes, ohw * g.kh * g.kw, |plane| {
        let (op, ip, pp) = (op, ip, pp);
        let src = &x[plane * hw..(plane + 1) * hw];
        // SAFETY: each plane's output, index and position blocks are written by this task only.
        let dst = unsafe { std::slice::from_raw_parts_mut(op.0.add(plane * ohw), ohw) };
        // SAFETY: as above.
        let mut ix = ip.map(|p| unsafe { std::slice::from_raw_parts_mut(p.0.add(plane * ohw), ohw) });
        // SAFETY: as above.
        let mut pos = pp.map(|p| unsafe { std::slice::from_raw_parts_mut(p.0.add(plane * ohw * width), ohw * width) });
        for oh in 0..g.oh {
            let hs = (oh * g.sh) as isize - g.ph as isize;
            let (ilo, ihi) = taps(hs, g.dh, g.kh, g.h);
            for (ow, &(ws, jlo, jhi)) in cols.iter().enumerate() {
                let (best, bi, bj) = if plain {
                    // Rows 2oh, 2oh+1 and columns 2ow, 2ow+1, all inside the input.
                    let (r0, r1) = (&src[2 * oh * g.w + 2 * ow..][..2], &src[(2 * oh + 1) * g.w + 2 * ow..][..2]);
                    let (mut best, mut at) = (r0[0], 0);
                    for (k, v) in [(1, r0[1]), (2, r1[0]), (3, r1[1])] {
                        if v > best || v.is_nan() {
                            best = v;
                            at = k;
                        }
                    }
                    (best, at / 2, at % 2)
                } else {
                    let mut best = <T as num_traits::Float>::neg_infinity();
                    let (mut bi, mut bj) = (ilo, jlo);
                    for i in ilo..ihi {
                        let row = &src[(hs + (i * g.dh) as isize) as usize * g.w..][..g.w];
                        for j in jlo..jhi {
                            let v = row[(ws + (j * g.dw) as isize) as usize];
                            // As PyTorch: a strictly larger value or a NaN takes over.
                            if v > best || v.is_nan() {
                                best = v;
                                bi = i;
                                bj = j;
                            }
                        }
                    }
                    (best, bi, bj)
                };
                let e = oh * g.ow + ow;
                dst[e] = best;
                if let Some(ix) = ix.as_deref_mut() {
                    let ih = hs + (bi * g.dh) as isize;
                    let iw = ws + (bj * g.dw) as isize;
                    ix[e] = ih as i64 * g.w as i64 + iw as i64;
                }
                if let Some(pos) = pos.as_deref_mut() {
                    let at = (bi * g.kw + bj) as u32;
                    if width == 1 {
                        pos[e] = at as u8;
                    } else {
                        pos[e * width..(e + 1) * width].copy_from_slice(&at.to_le_bytes()[..width]);
                    }
                }
            }
        }
    });
}

fn max_backward<T: Float>(g: &PoolGeom, width: usize, gs: &[T], pos: &[u8], dx: &mut [T]) {
    let (hw, ohw) = (g.hw(), g.ohw());
    // Offsets (rows, cols) of every window position from the window's origin.
    let offsets: Vec<(isize, isize)> =
        (0..g.kh * g.kw).map(|at| (((at / g.kw) * g.dh) as isize, ((at % g.kw) * g.dw) as isize)).collect();
    let (h, w) = (g.h as isize, g.w as isize);
    let dp = SendPtr(dx.as_mut_ptr());
    for_planes(g.planes, ohw + hw, |plane| {
        let dp = &dp; // capture the whole SendPtr, not its raw field
                      // SAFETY: each plane's gradient block is written by this task only.
        let d = unsafe { std::slice::from_raw_parts_mut(dp.0.add(plane * hw), hw) };
        d.fill(T::zero());
        let gp = &gs[plane * ohw..(plane + 1) * ohw];
        let pp = &pos[plane * ohw * width..(plane + 1) * ohw * width];
        for oh in 0..g.oh {
            let hs = (oh * g.sh) as isize - g.ph as isize;
            for ow in 0..g.ow {
                let e = oh * g.ow + ow;
                let at = if width == 1 {
                    pp[e] as usize
                } else {
                    let mut bytes = [0u8; 4];
                    bytes[..width].copy_from_slice(&pp[e * width..(e + 1) * width]);
                    u32::from_le_bytes(bytes) as usize
                };
                let Some(&(di, dj)) = offsets.get(at) else { continue };
                let (ih, iw) = (hs + di, (ow * g.sw) as isize - g.pw as isize + dj);
                // An all-padding window (possible only with dilation) has no input to credit.
                if ih >= 0 && iw >= 0 && ih < h && iw < w {
                    d[(ih * w + iw) as usize] += gp[e];
                }
            }
        }
    });
}

/// One avg-pool window per output: rows `h0..h1`, cols `w0..w1` (clamped to the input) and the divisor.
#[derive(Clone, Copy)]
struct AvgWindow {
    h0: usize,
    h1: usize,
    w0: usize,
    w1: usize,
    divisor: usize,
}

/// PyTorch's avg_pool2d window: the divisor counts padding up to `size + pad` when `count_include_pad`.
fn avg_window_1d(o: usize, k: usize, s: usize, p: usize, size: usize) -> (usize, usize, usize) {
    let start = (o * s) as isize - p as isize;
    let end = (start + k as isize).min((size + p) as isize);
    let span = (end - start).max(0) as usize;
    let (lo, hi) = (start.max(0) as usize, end.clamp(0, size as isize) as usize);
    (lo, hi.max(lo), span)
}

fn avg_window(g: &PoolGeom, kind: Avg, oh: usize, ow: usize) -> AvgWindow {
    match kind {
        Avg::Fixed { count_include_pad } => {
            let (h0, h1, sh) = avg_window_1d(oh, g.kh, g.sh, g.ph, g.h);
            let (w0, w1, sw) = avg_window_1d(ow, g.kw, g.sw, g.pw, g.w);
            let divisor = if count_include_pad { sh * sw } else { (h1 - h0) * (w1 - w0) };
            AvgWindow { h0, h1, w0, w1, divisor }
        }
        Avg::Adaptive => {
            let (h0, h1) = (oh * g.h / g.oh, ((oh + 1) * g.h).div_ceil(g.oh));
            let (w0, w1) = (ow * g.w / g.ow, ((ow + 1) * g.w).div_ceil(g.ow));
            AvgWindow { h0, h1, w0, w1, divisor: (h1 - h0) * (w1 - w0) }
        }
    }
}

/// Largest window extent, for the parallel work estimate.
fn avg_window_area(g: &PoolGeom, kind: Avg) -> usize {
    match kind {
        Avg::Fixed { .. } => g.kh * g.kw,
        Avg::Adaptive => (g.h.div_ceil(g.oh) + 1) * (g.w.div_ceil(g.ow) + 1),
    }
}
