//! 2-D pooling over NCHW: max_pool2d (with flat `h*W + w` indices), avg_pool2d and adaptive_avg_pool2d.
//!
//! Inputs may also be unbatched `[C, H, W]`; kernels work plane by plane (one plane per (n, c)), in
//! parallel for large inputs. For its backward, max_pool2d saves neither the input nor int64 indices
//! but the position of each maximum inside its window, in 1, 2 or 4 bytes (a `u8` tensor), chosen
//! from the window size. The average pools save nothing but shapes.

use super::matmul::SendPtr;
use super::output;
use crate::autograd::{needs_grad, record, save, Backward};
use crate::dtype::{DType, Float};
use crate::error::{Error, Result};
use crate::tensor::Tensor;
use crate::with_float;
use num_traits::Zero as _;
use rayon::prelude::*;

/// Hyper-parameters of a 2-D pooling window, `[h, w]` pairs as in PyTorch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pool2dParams {
    pub kernel: [usize; 2],
    pub stride: [usize; 2],
    pub padding: [usize; 2],
    pub dilation: [usize; 2],
    pub ceil_mode: bool,
}

impl Pool2dParams {
    /// A square window of `k` with stride `k` (the common `max_pool2d(x, k)`).
    pub fn square(k: usize) -> Self {
        Pool2dParams { kernel: [k, k], stride: [k, k], padding: [0, 0], dilation: [1, 1], ceil_mode: false }
    }
}

/// The shapes of one pooling: `planes` independent [h, w] -> [oh, ow] planes.
#[derive(Clone, Copy, Debug)]
struct Geom {
    planes: usize,
    h: usize,
    w: usize,
    oh: usize,
    ow: usize,
    kh: usize,
    kw: usize,
    sh: usize,
    sw: usize,
    ph: usize,
    pw: usize,
    dh: usize,
    dw: usize,
}

impl Geom {
    fn hw(&self) -> usize {
        self.h * self.w
    }
    fn ohw(&self) -> usize {
        self.oh * self.ow
    }
}

/// Checks the input is [N, C, H, W] or [C, H, W] with non-empty planes; returns (planes, h, w).
fn planes_of(op: &str, x: &Tensor) -> Result<(usize, usize, usize)> {
    let s = x.shape();
    if s.len() != 3 && s.len() != 4 {
        return Err(Error::shape(format!("{op}: input must be [N, C, H, W] or [C, H, W], got {s:?}")));
    }
    let r = s.len();
    if s[r - 1] == 0 || s[r - 2] == 0 {
        return Err(Error::shape(format!("{op}: input {s:?} has an empty spatial dim")));
    }
    match x.dtype() {
        DType::F32 | DType::F64 => {}
        other => return Err(Error::dtype(format!("{op} supports f32 and f64, not {other}"))),
    }
    Ok((s[..r - 2].iter().product(), s[r - 2], s[r - 1]))
}

/// The input's shape with the last two dims replaced.
fn out_shape(x: &Tensor, oh: usize, ow: usize) -> Vec<usize> {
    let s = x.shape();
    let mut out = s[..s.len() - 2].to_vec();
    out.extend([oh, ow]);
    out
}

/// PyTorch's pooling output size; in ceil mode the last window must start inside the input or the
/// left padding.
fn pool_out_size(size: usize, k: usize, s: usize, p: usize, d: usize, ceil: bool) -> i128 {
    let (size, k, s, p, d) = (size as i128, k as i128, s as i128, p as i128, d as i128);
    let num = size + 2 * p - d * (k - 1) - 1 + if ceil { s - 1 } else { 0 };
    let mut out = num.div_euclid(s) + 1;
    if ceil && (out - 1) * s >= size + p {
        out -= 1;
    }
    out
}

fn geometry(op: &str, x: &Tensor, params: &Pool2dParams) -> Result<Geom> {
    let (planes, h, w) = planes_of(op, x)?;
    let Pool2dParams { kernel, stride, padding, dilation, ceil_mode } = *params;
    if kernel.contains(&0) {
        return Err(Error::shape(format!("{op}: kernel size {kernel:?} must be positive")));
    }
    if stride.contains(&0) {
        return Err(Error::shape(format!("{op}: stride {stride:?} must be positive")));
    }
    if dilation.contains(&0) {
        return Err(Error::shape(format!("{op}: dilation {dilation:?} must be positive")));
    }
    if padding[0] > kernel[0] / 2 || padding[1] > kernel[1] / 2 {
        return Err(Error::shape(format!(
            "{op}: padding {padding:?} should be at most half of the kernel size {kernel:?}"
        )));
    }
    let oh = pool_out_size(h, kernel[0], stride[0], padding[0], dilation[0], ceil_mode);
    let ow = pool_out_size(w, kernel[1], stride[1], padding[1], dilation[1], ceil_mode);
    if oh < 1 || ow < 1 {
        return Err(Error::shape(format!(
            "{op}: input {:?} with kernel {kernel:?}, stride {stride:?}, padding {padding:?}, dilation {dilation:?} \
             gives output size {oh}x{ow}, which is too small",
            x.shape()
        )));
    }
    Ok(Geom {
        planes,
        h,
        w,
        oh: oh as usize,
        ow: ow as usize,
        kh: kernel[0],
        kw: kernel[1],
        sh: stride[0],
        sw: stride[1],
        ph: padding[0],
        pw: padding[1],
        dh: dilation[0],
        dw: dilation[1],
    })
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

/// Bytes per saved window position: enough for `kh*kw` positions.
fn index_width(window: usize) -> usize {
    if window <= 1 << 8 {
        1
    } else if window <= 1 << 16 {
        2
    } else {
        4
    }
}

/// `F.max_pool2d`: pads with -inf, first maximum in row-major window order wins.
pub fn max_pool2d(x: &Tensor, params: Pool2dParams) -> Result<Tensor> {
    Ok(max_pool(x, params, false)?.0)
}

/// `F.max_pool2d(..., return_indices=True)`: indices are int64 flat `h*W + w` positions per (n, c) plane.
pub fn max_pool2d_with_indices(x: &Tensor, params: Pool2dParams) -> Result<(Tensor, Tensor)> {
    let (out, indices) = max_pool(x, params, true)?;
    let indices = indices.ok_or_else(|| Error::invalid("internal: max_pool2d lost its indices"))?;
    Ok((out, indices))
}

fn max_pool(x: &Tensor, params: Pool2dParams, want_indices: bool) -> Result<(Tensor, Option<Tensor>)> {
    let g = geometry("max_pool2d", x, &params)?;
    let x = x.contiguous()?;
    let shape = out_shape(&x, g.oh, g.ow);
    let out = output(&x, &shape, x.dtype(), "max_pool2d")?;
    let indices = if want_indices { Some(output(&x, &shape, DType::I64, "max_pool2d")?) } else { None };
    let grad = needs_grad(&[&x]);
    let width = index_width(g.kh * g.kw);
    let positions = if grad { Some(output(&x, &[out.numel() * width], DType::U8, "max_pool2d")?) } else { None };
    if x.device().computes() {
        with_float!(x.dtype(), "max_pool2d", T => {
            let ix = match &indices {
                Some(t) => Some(t.slice_mut::<i64>()?),
                None => None,
            };
            let pos = match &positions {
                Some(t) => Some(t.slice_mut::<u8>()?),
                None => None,
            };
            max_forward::<T>(&g, x.slice::<T>()?, out.slice_mut::<T>()?, ix, pos, width);
        });
    }
    let out = match positions {
        Some(pos) => {
            let back = MaxPoolBack { positions: save(&pos), geom: g, width, input_shape: x.shape().to_vec() };
            record(out, "max_pool2d", &[&x], back)
        }
        None => out,
    };
    Ok((out, indices))
}

fn max_forward<T: Float>(
    g: &Geom,
    x: &[T],
    out: &mut [T],
    indices: Option<&mut [i64]>,
    positions: Option<&mut [u8]>,
    width: usize,
) {
    let (hw, ohw) = (g.hw(), g.ohw());
    let op = SendPtr(out.as_mut_ptr());
    let ip = indices.map(|s| SendPtr(s.as_mut_ptr()));
    let pp = positions.map(|s| SendPtr(s.as_mut_ptr()));
    for_planes(g.planes, ohw * g.kh * g.kw, |plane| {
        let (op, ip, pp) = (op, ip, pp);
        let src = &x[plane * hw..(plane + 1) * hw];
        // SAFETY: each plane's output, index and position blocks are written by this task only.
        let dst = unsafe { std::slice::from_raw_parts_mut(op.0.add(plane * ohw), ohw) };
        // SAFETY: as above.
        let ix = ip.map(|p| unsafe { std::slice::from_raw_parts_mut(p.0.add(plane * ohw), ohw) });
        // SAFETY: as above.
        let pos = pp.map(|p| unsafe { std::slice::from_raw_parts_mut(p.0.add(plane * ohw * width), ohw * width) });
        let (mut ix, mut pos) = (ix, pos);
        for oh in 0..g.oh {
            let hs = (oh * g.sh) as isize - g.ph as isize;
            let (ilo, ihi) = taps(hs, g.dh, g.kh, g.h);
            for ow in 0..g.ow {
                let ws = (ow * g.sw) as isize - g.pw as isize;
                let (jlo, jhi) = taps(ws, g.dw, g.kw, g.w);
                let mut best = <T as num_traits::Float>::neg_infinity();
                let (mut bi, mut bj) = (ilo, jlo);
                for i in ilo..ihi {
                    let row = &src[(hs + (i * g.dh) as isize) as usize * g.w..];
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
                let e = oh * g.ow + ow;
                dst[e] = best;
                if let Some(ix) = ix.as_deref_mut() {
                    let ih = hs + (bi * g.dh) as isize;
                    let iw = ws + (bj * g.dw) as isize;
                    ix[e] = ih as i64 * g.w as i64 + iw as i64;
                }
                if let Some(pos) = pos.as_deref_mut() {
                    let at = (bi * g.kw + bj) as u32;
                    pos[e * width..(e + 1) * width].copy_from_slice(&at.to_le_bytes()[..width]);
                }
            }
        }
    });
}

struct MaxPoolBack {
    /// Position of each maximum inside its window (`i*kw + j`), `width` little-endian bytes each.
    positions: Tensor,
    geom: Geom,
    width: usize,
    input_shape: Vec<usize>,
}

impl Backward for MaxPoolBack {
    fn backward(self: Box<Self>, grad: Tensor, _: &[bool]) -> Result<Vec<Option<Tensor>>> {
        let grad = grad.contiguous()?;
        let (g, width) = (self.geom, self.width);
        let dx = output(&grad, &self.input_shape, grad.dtype(), "max_pool2d_backward")?;
        if grad.device().computes() {
            with_float!(grad.dtype(), "max_pool2d_backward", T => {
                let (gs, pos) = (grad.slice::<T>()?, self.positions.slice::<u8>()?);
                let (hw, ohw) = (g.hw(), g.ohw());
                let dp = SendPtr(dx.slice_mut::<T>()?.as_mut_ptr());
                for_planes(g.planes, ohw + hw, |plane| {
                    let dp = dp;
                    // SAFETY: each plane's gradient block is written by this task only.
                    let d = unsafe { std::slice::from_raw_parts_mut(dp.0.add(plane * hw), hw) };
                    d.fill(T::zero());
                    let gp = &gs[plane * ohw..(plane + 1) * ohw];
                    let pp = &pos[plane * ohw * width..(plane + 1) * ohw * width];
                    for (e, (&gv, b)) in gp.iter().zip(pp.chunks_exact(width)).enumerate() {
                        let mut bytes = [0u8; 4];
                        bytes[..width].copy_from_slice(b);
                        let at = u32::from_le_bytes(bytes) as usize;
                        let (i, j) = (at / g.kw, at % g.kw);
                        let ih = ((e / g.ow) * g.sh + i * g.dh) as isize - g.ph as isize;
                        let iw = ((e % g.ow) * g.sw + j * g.dw) as isize - g.pw as isize;
                        // An all-padding window (possible only with dilation) has no input to credit.
                        if ih >= 0 && iw >= 0 && (ih as usize) < g.h && (iw as usize) < g.w {
                            d[ih as usize * g.w + iw as usize] += gv;
                        }
                    }
                });
            });
        }
        Ok(vec![Some(dx)])
    }
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

#[derive(Clone, Copy, Debug)]
enum Avg {
    Fixed { count_include_pad: bool },
    Adaptive,
}

fn avg_window(g: &Geom, kind: Avg, oh: usize, ow: usize) -> AvgWindow {
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
fn avg_window_area(g: &Geom, kind: Avg) -> usize {
    match kind {
        Avg::Fixed { .. } => g.kh * g.kw,
        Avg::Adaptive => (g.h.div_ceil(g.oh) + 1) * (g.w.div_ceil(g.ow) + 1),
    }
}

/// `F.avg_pool2d` (divisor_override None). Uses kernel/stride/padding/ceil_mode of `params`; dilation must be 1.
pub fn avg_pool2d(x: &Tensor, params: Pool2dParams, count_include_pad: bool) -> Result<Tensor> {
    if params.dilation != [1, 1] {
        return Err(Error::shape(format!("avg_pool2d: dilation {:?} is not supported (must be [1, 1])", params.dilation)));
    }
    let g = geometry("avg_pool2d", x, &params)?;
    avg_pool(x, g, Avg::Fixed { count_include_pad }, "avg_pool2d")
}

/// `F.adaptive_avg_pool2d`: window i spans floor(i*H/out) .. ceil((i+1)*H/out).
pub fn adaptive_avg_pool2d(x: &Tensor, output_size: [usize; 2]) -> Result<Tensor> {
    let op = "adaptive_avg_pool2d";
    let (planes, h, w) = planes_of(op, x)?;
    if output_size.contains(&0) {
        return Err(Error::shape(format!("{op}: output size {output_size:?} must be positive")));
    }
    let [oh, ow] = output_size;
    let g = Geom { planes, h, w, oh, ow, kh: 1, kw: 1, sh: 1, sw: 1, ph: 0, pw: 0, dh: 1, dw: 1 };
    avg_pool(x, g, Avg::Adaptive, op)
}

fn avg_pool(x: &Tensor, g: Geom, kind: Avg, op: &'static str) -> Result<Tensor> {
    let x = x.contiguous()?;
    let out = output(&x, &out_shape(&x, g.oh, g.ow), x.dtype(), op)?;
    if x.device().computes() {
        with_float!(x.dtype(), op, T => {
            let src = x.slice::<T>()?;
            let (hw, ohw) = (g.hw(), g.ohw());
            let dp = SendPtr(out.slice_mut::<T>()?.as_mut_ptr());
            for_planes(g.planes, ohw * avg_window_area(&g, kind), |plane| {
                let dp = dp;
                let s = &src[plane * hw..(plane + 1) * hw];
                // SAFETY: each plane's output block is written by this task only.
                let d = unsafe { std::slice::from_raw_parts_mut(dp.0.add(plane * ohw), ohw) };
                for oh in 0..g.oh {
                    for ow in 0..g.ow {
                        let win = avg_window(&g, kind, oh, ow);
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
    }
    if !needs_grad(&[&x]) {
        return Ok(out);
    }
    Ok(record(out, op, &[&x], AvgPoolBack { geom: g, kind, input_shape: x.shape().to_vec(), op }))
}

struct AvgPoolBack {
    geom: Geom,
    kind: Avg,
    input_shape: Vec<usize>,
    op: &'static str,
}

impl Backward for AvgPoolBack {
    fn backward(self: Box<Self>, grad: Tensor, _: &[bool]) -> Result<Vec<Option<Tensor>>> {
        let grad = grad.contiguous()?;
        let (g, kind) = (self.geom, self.kind);
        let name = if matches!(kind, Avg::Adaptive) { "adaptive_avg_pool2d_backward" } else { "avg_pool2d_backward" };
        let dx = output(&grad, &self.input_shape, grad.dtype(), name)?;
        if grad.device().computes() {
            with_float!(grad.dtype(), self.op, T => {
                let gs = grad.slice::<T>()?;
                let (hw, ohw) = (g.hw(), g.ohw());
                let dp = SendPtr(dx.slice_mut::<T>()?.as_mut_ptr());
                for_planes(g.planes, hw + ohw * avg_window_area(&g, kind), |plane| {
                    let dp = dp;
                    // SAFETY: each plane's gradient block is written by this task only.
                    let d = unsafe { std::slice::from_raw_parts_mut(dp.0.add(plane * hw), hw) };
                    d.fill(T::zero());
                    let gp = &gs[plane * ohw..(plane + 1) * ohw];
                    for oh in 0..g.oh {
                        for ow in 0..g.ow {
                            let win = avg_window(&g, kind, oh, ow);
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
        }
        Ok(vec![Some(dx)])
    }
}
