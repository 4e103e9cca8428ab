//! 2-D pooling over NCHW: max_pool2d (with flat `h*W + w` indices), avg_pool2d and adaptive_avg_pool2d.
//!
//! Inputs may also be unbatched `[C, H, W]`; kernels work plane by plane (one plane per (n, c)), in
//! parallel for large inputs. For its backward, max_pool2d saves neither the input nor int64 indices
//! but the position of each maximum inside its window, in 1, 2 or 4 bytes (a `u8` tensor), chosen
//! from the window size. The average pools save nothing but shapes. The kernels are the backend's
//! (`memfit-cpu`'s `pool.rs`).

use super::output;
use crate::autograd::{needs_grad, record, save, Backward};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::tensor::Tensor;
pub(crate) use memfit_cpu::pool::{Avg, PoolGeom};

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

fn geometry(op: &str, x: &Tensor, params: &Pool2dParams) -> Result<PoolGeom> {
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
    Ok(PoolGeom {
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
    let _op = x.device().op_scope("max_pool2d");
    let (out, indices) = max_pool(x, params, true)?;
    let indices = indices.ok_or_else(|| Error::invalid("internal: max_pool2d lost its indices"))?;
    Ok((out, indices))
}

fn max_pool(x: &Tensor, params: Pool2dParams, want_indices: bool) -> Result<(Tensor, Option<Tensor>)> {
    let g = geometry("max_pool2d", x, &params)?;
    let x = x.contiguous()?;
    let shape = out_shape(&x, g.oh, g.ow);
    let out = output(&x, &shape, x.dtype(), "max_pool2d")?;
    let indices = if want_indices { Some(super::output_any(&x, &shape, DType::I64, "max_pool2d")?) } else { None };
    let grad = needs_grad(&[&x]);
    let width = index_width(g.kh * g.kw);
    let positions =
        if grad { Some(super::output_any(&x, &[out.numel() * width], DType::U8, "max_pool2d")?) } else { None };
    x.device().backend().max_pool2d(&g, &x, &out, indices.as_ref(), positions.as_ref(), width)?;
    let out = match positions {
        Some(pos) => {
            let back = MaxPoolBack { positions: save(&pos), geom: g, width, input_shape: x.shape().to_vec() };
            record(out, "max_pool2d", &[&x], back)
        }
        None => out,
    };
    Ok((out, indices))
}

struct MaxPoolBack {
    /// Position of each maximum inside its window (`i*kw + j`), `width` little-endian bytes each.
    positions: Tensor,
    geom: PoolGeom,
    width: usize,
    input_shape: Vec<usize>,
}

impl Backward for MaxPoolBack {
    fn backward(self: Box<Self>, grad: Tensor, _: &[bool]) -> Result<Vec<Option<Tensor>>> {
        let grad = grad.contiguous()?;
        let (g, width) = (self.geom, self.width);
        let dx = output(&grad, &self.input_shape, grad.dtype(), "max_pool2d_backward")?;
        grad.device().backend().max_pool2d_backward(&g, width, &grad, &self.positions, &dx)?;
        Ok(vec![Some(dx)])
    }
}

/// `F.avg_pool2d` (divisor_override None). Uses kernel/stride/padding/ceil_mode of `params`; dilation must be 1.
pub fn avg_pool2d(x: &Tensor, params: Pool2dParams, count_include_pad: bool) -> Result<Tensor> {
    let _op = x.device().op_scope("avg_pool2d");
    if params.dilation != [1, 1] {
        return Err(Error::shape(format!(
            "avg_pool2d: dilation {:?} is not supported (must be [1, 1])",
            params.dilation
        )));
    }
    let g = geometry("avg_pool2d", x, &params)?;
    avg_pool(x, g, Avg::Fixed { count_include_pad }, "avg_pool2d")
}

/// `F.adaptive_avg_pool2d`: window i spans floor(i*H/out) .. ceil((i+1)*H/out).
pub fn adaptive_avg_pool2d(x: &Tensor, output_size: [usize; 2]) -> Result<Tensor> {
    let _op = x.device().op_scope("adaptive_avg_pool2d");
    let op = "adaptive_avg_pool2d";
    let (planes, h, w) = planes_of(op, x)?;
    if output_size.contains(&0) {
        return Err(Error::shape(format!("{op}: output size {output_size:?} must be positive")));
    }
    let [oh, ow] = output_size;
    let g = PoolGeom { planes, h, w, oh, ow, kh: 1, kw: 1, sh: 1, sw: 1, ph: 0, pw: 0, dh: 1, dw: 1 };
    avg_pool(x, g, Avg::Adaptive, op)
}

fn avg_pool(x: &Tensor, g: PoolGeom, kind: Avg, op: &'static str) -> Result<Tensor> {
    let x = x.contiguous()?;
    let out = output(&x, &out_shape(&x, g.oh, g.ow), x.dtype(), op)?;
    x.device().backend().avg_pool2d(&g, kind, &x, &out)?;
    if !needs_grad(&[&x]) {
        return Ok(out);
    }
    Ok(record(out, op, &[&x], AvgPoolBack { geom: g, kind, input_shape: x.shape().to_vec() }))
}

struct AvgPoolBack {
    geom: PoolGeom,
    kind: Avg,
    input_shape: Vec<usize>,
}

impl Backward for AvgPoolBack {
    fn backward(self: Box<Self>, grad: Tensor, _: &[bool]) -> Result<Vec<Option<Tensor>>> {
        let grad = grad.contiguous()?;
        let (g, kind) = (self.geom, self.kind);
        let name = if matches!(kind, Avg::Adaptive) { "adaptive_avg_pool2d_backward" } else { "avg_pool2d_backward" };
        let dx = output(&grad, &self.input_shape, grad.dtype(), name)?;
        grad.device().backend().avg_pool2d_backward(&g, kind, &grad, &dx)?;
        Ok(vec![Some(dx)])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::autograd::backward_with;
    use crate::memory::{Category, EventKind, Phase};
    use crate::Device;

    fn leaf(dev: &Device, data: &[f64], shape: &[usize], grad: bool) -> Tensor {
        let t = Tensor::from_slice(dev, data, shape, Category::Parameter).unwrap();
        if grad {
            t.set_requires_grad(true)
        } else {
            t
        }
    }

    fn pool(k: [usize; 2], s: [usize; 2], p: [usize; 2], d: [usize; 2], ceil: bool) -> Pool2dParams {
        Pool2dParams { kernel: k, stride: s, padding: p, dilation: d, ceil_mode: ceil }
    }

    /// Distinct values (a shuffled ramp), so finite differences never cross a tie.
    fn distinct(seed: u64, n: usize) -> Vec<f64> {
        let mut v: Vec<f64> = (0..n).map(|i| i as f64 * 0.1 - n as f64 * 0.05).collect();
        let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
        for i in (1..n).rev() {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            v.swap(i, (s >> 33) as usize % (i + 1));
        }
        v
    }

    fn ones(dev: &Device, shape: &[usize]) -> Tensor {
        Tensor::full(dev, shape, 1.0, DType::F64, Category::Input).unwrap()
    }

    #[test]
    fn max_pool_ties_pick_the_first_maximum() {
        let dev = Device::cpu();
        #[rustfmt::skip]
        let xv = [1., 3., 3., 0.,
                  3., 2., 1., 3.,
                  0., 0., 5., 5.,
                  0., 0., 5., 5.];
        let x = leaf(&dev, &xv, &[1, 1, 4, 4], true);
        let (out, ix) = max_pool2d_with_indices(&x, Pool2dParams::square(2)).unwrap();
        assert_eq!(out.to_f64_vec().unwrap(), [3., 3., 0., 5.]);
        assert_eq!(ix.dtype(), DType::I64);
        assert_eq!(ix.to_vec::<i64>().unwrap(), [1, 2, 8, 10]);
        backward_with(&out, ones(&dev, &[1, 1, 2, 2])).unwrap();
        let mut want = [0.0; 16];
        for i in [1, 2, 8, 10] {
            want[i] = 1.0;
        }
        assert_eq!(x.grad().unwrap().to_f64_vec().unwrap(), want);
    }

    #[test]
    fn max_pool_overlap_padding_and_ceil_mode() {
        let dev = Device::cpu();
        // Overlapping windows that share their maximum accumulate its gradient.
        let x = leaf(&dev, &[1., 2., 3., 4., 5., 9., 7., 8., 1., 2., 3., 4.], &[1, 1, 3, 4], true);
        let (out, ix) = max_pool2d_with_indices(&x, pool([3, 3], [1, 1], [0, 0], [1, 1], false)).unwrap();
        assert_eq!(out.to_f64_vec().unwrap(), [9., 9.]);
        assert_eq!(ix.to_vec::<i64>().unwrap(), [5, 5]);
        backward_with(&out, ones(&dev, &[1, 1, 1, 2])).unwrap();
        assert_eq!(x.grad().unwrap().to_f64_vec().unwrap(), [0., 0., 0., 0., 0., 2., 0., 0., 0., 0., 0., 0.]);
        // Padding is -inf, not 0.
        let x = leaf(&dev, &[-4., -3., -2., -1.], &[1, 1, 2, 2], false);
        let (out, ix) = max_pool2d_with_indices(&x, pool([2, 2], [2, 2], [1, 1], [1, 1], false)).unwrap();
        assert_eq!(out.to_f64_vec().unwrap(), [-4., -3., -2., -1.]);
        assert_eq!(ix.to_vec::<i64>().unwrap(), [0, 1, 2, 3]);
        // Ceil mode keeps a last partial window.
        let xv: Vec<f64> = (0..25).map(f64::from).collect();
        let x = leaf(&dev, &xv, &[1, 1, 5, 5], false);
        let out = max_pool2d(&x, pool([2, 2], [2, 2], [0, 0], [1, 1], true)).unwrap();
        assert_eq!(out.shape(), [1, 1, 3, 3]);
        assert_eq!(out.to_f64_vec().unwrap(), [6., 8., 9., 16., 18., 19., 21., 23., 24.]);
        assert_eq!(max_pool2d(&x, Pool2dParams::square(2)).unwrap().shape(), [1, 1, 2, 2]);
        // Several planes on the 2x2 fast path (a gradient to come): the values of the general path,
        // and each window's gradient at its maximum, plane by plane.
        let v: Vec<f64> = (0..96).map(|i| ((i * 37) % 96) as f64).collect();
        let (general, ix) =
            max_pool2d_with_indices(&leaf(&dev, &v, &[2, 3, 4, 4], false), Pool2dParams::square(2)).unwrap();
        let x = leaf(&dev, &v, &[2, 3, 4, 4], true);
        let out = max_pool2d(&x, Pool2dParams::square(2)).unwrap();
        assert_eq!(out.to_f64_vec().unwrap(), general.to_f64_vec().unwrap());
        backward_with(&out, ones(&dev, &[2, 3, 2, 2])).unwrap();
        let mut want = vec![0.0; 96];
        for (k, &i) in ix.to_vec::<i64>().unwrap().iter().enumerate() {
            want[(k / 4) * 16 + i as usize] += 1.0;
        }
        assert_eq!(x.grad().unwrap().to_f64_vec().unwrap(), want);
        // Dilation 2 and padding 1 on one row: every window's taps in the height fall in the
        // padding, so each output is -inf and its gradient goes to no input.
        let x = leaf(&dev, &[1., 2., 3.], &[1, 1, 1, 3], true);
        let out = max_pool2d(&x, pool([2, 2], [1, 1], [1, 1], [2, 2], false)).unwrap();
        assert_eq!(out.to_f64_vec().unwrap(), [f64::NEG_INFINITY; 3]);
        backward_with(&out, ones(&dev, &[1, 1, 1, 3])).unwrap();
        assert_eq!(x.grad().unwrap().to_f64_vec().unwrap(), [0.; 3]);
        // With and without a gradient to come (then the window positions are saved, and plain 2x2
        // windows take their fast path): several output rows and columns; partial last windows in
        // the width only or the height only are not plain.
        for grad in [false, true] {
            let x55 = leaf(&dev, &xv, &[1, 1, 5, 5], grad);
            let out = max_pool2d(&x55, Pool2dParams::square(2)).unwrap();
            assert_eq!(out.to_f64_vec().unwrap(), [6., 8., 16., 18.], "grad {grad}");
            let x45 = leaf(&dev, &xv[..20], &[1, 1, 4, 5], grad);
            let out = max_pool2d(&x45, pool([2, 2], [2, 2], [0, 0], [1, 1], true)).unwrap();
            assert_eq!(out.to_f64_vec().unwrap(), [6., 8., 9., 16., 18., 19.], "grad {grad}");
            let x54 = leaf(&dev, &xv[..20], &[1, 1, 5, 4], grad);
            let out = max_pool2d(&x54, pool([2, 2], [2, 2], [0, 0], [1, 1], true)).unwrap();
            assert_eq!(out.to_f64_vec().unwrap(), [5., 7., 13., 15., 17., 19.], "grad {grad}");
        }
        // ...but never one that starts in the right padding: 4 + 2*1 with k 2, s 3 gives 2, not 3.
        let x = leaf(&dev, &[0.0; 16], &[1, 1, 4, 4], false);
        assert_eq!(max_pool2d(&x, pool([2, 2], [3, 3], [1, 1], [1, 1], true)).unwrap().shape(), [1, 1, 2, 2]);
        // Unbatched input.
        let x = leaf(&dev, &xv, &[1, 5, 5], false);
        assert_eq!(max_pool2d(&x, Pool2dParams::square(2)).unwrap().to_f64_vec().unwrap(), [6., 8., 16., 18.]);
    }

    /// PyTorch's floor((H + 2p - d(k - 1) - 1) / s) + 1 with padding on both sides, and padding of at
    /// most half the kernel in each dim (refused in either alone).
    #[test]
    fn output_sizes_count_padding_on_both_sides_and_too_much_padding_is_refused() {
        let dev = Device::cpu();
        let x = leaf(&dev, &[0.0; 49], &[1, 1, 7, 7], false);
        let shape = |p: Pool2dParams| max_pool2d(&x, p).map(|t| t.shape().to_vec());
        assert_eq!(shape(pool([3, 3], [1, 1], [1, 1], [1, 1], false)).unwrap(), [1, 1, 7, 7]);
        assert_eq!(shape(pool([7, 3], [2, 1], [3, 0], [1, 1], false)).unwrap(), [1, 1, 4, 5]);
        assert_eq!(shape(pool([2, 2], [1, 1], [1, 1], [1, 1], false)).unwrap(), [1, 1, 8, 8], "p = k / 2 is allowed");
        // Ceil mode keeps a last window that starts inside the input: 2x2 stride 2 over 3x3 gives 2x2.
        let three = leaf(&dev, &[0.0; 9], &[1, 1, 3, 3], false);
        assert_eq!(max_pool2d(&three, pool([2, 2], [2, 2], [0, 0], [1, 1], true)).unwrap().shape(), [1, 1, 2, 2]);
        // Ceil mode with stride 1 adds no window: 2x2 windows over 2x2 give one.
        let small = leaf(&dev, &[0.0; 4], &[1, 1, 2, 2], false);
        assert_eq!(max_pool2d(&small, pool([2, 2], [1, 1], [0, 0], [1, 1], true)).unwrap().shape(), [1, 1, 1, 1]);
        let avg = avg_pool2d(&x, pool([3, 3], [1, 1], [1, 1], [1, 1], false), true).unwrap();
        assert_eq!(avg.shape(), [1, 1, 7, 7]);
        for p in [[2, 0], [0, 2]] {
            let err = shape(pool([3, 3], [1, 1], p, [1, 1], false)).unwrap_err();
            assert!(err.to_string().contains("at most half of the kernel size"), "{p:?}: {err}");
        }
    }

    #[test]
    fn avg_pool_divisors() {
        let dev = Device::cpu();
        let xv: Vec<f64> = (1..=9).map(f64::from).collect();
        let x = leaf(&dev, &xv, &[1, 1, 3, 3], false);
        let p = pool([3, 3], [1, 1], [1, 1], [1, 1], false);
        let with_pad = avg_pool2d(&x, p, true).unwrap().to_f64_vec().unwrap();
        let without = avg_pool2d(&x, p, false).unwrap().to_f64_vec().unwrap();
        assert_eq!(with_pad[0], 12.0 / 9.0);
        assert_eq!(without[0], 3.0);
        assert_eq!(with_pad[4], 5.0);
        assert_eq!(without[4], 5.0);
        assert_eq!(without[1], (1. + 2. + 3. + 4. + 5. + 6.) / 6.0);
        // Ceil mode: the last window hangs over the right padding, which counts only up to H + pad.
        let xv: Vec<f64> = (0..36).map(f64::from).collect();
        let x = leaf(&dev, &xv, &[1, 1, 6, 6], false);
        let p = pool([3, 3], [2, 2], [1, 1], [1, 1], true);
        let with_pad = avg_pool2d(&x, p, true).unwrap();
        assert_eq!(with_pad.shape(), [1, 1, 4, 4]);
        assert_eq!(with_pad.to_f64_vec().unwrap()[15], 35.0 / 4.0);
        assert_eq!(avg_pool2d(&x, p, false).unwrap().to_f64_vec().unwrap()[15], 35.0);
        assert!(avg_pool2d(&x, pool([2, 2], [2, 2], [0, 0], [2, 2], false), true).is_err());
    }

    /// Naive references, straight from PyTorch's definitions.
    fn naive_max(x: &[f64], h: usize, w: usize, p: Pool2dParams, oh: usize, ow: usize) -> (Vec<f64>, Vec<i64>) {
        let (mut out, mut ix) = (vec![], vec![]);
        for plane in x.chunks(h * w) {
            for y in 0..oh {
                for xo in 0..ow {
                    let (mut best, mut at) = (f64::NEG_INFINITY, -1i64);
                    for i in 0..p.kernel[0] {
                        for j in 0..p.kernel[1] {
                            let ih = (y * p.stride[0] + i * p.dilation[0]) as i64 - p.padding[0] as i64;
                            let iw = (xo * p.stride[1] + j * p.dilation[1]) as i64 - p.padding[1] as i64;
                            if ih < 0 || iw < 0 || ih >= h as i64 || iw >= w as i64 {
                                continue;
                            }
                            let v = plane[(ih * w as i64 + iw) as usize];
                            if at < 0 || v > best {
                                best = v;
                                at = ih * w as i64 + iw;
                            }
                        }
                    }
                    out.push(best);
                    ix.push(at);
                }
            }
        }
        (out, ix)
    }

    fn naive_avg(x: &[f64], h: usize, w: usize, p: Pool2dParams, include: bool, oh: usize, ow: usize) -> Vec<f64> {
        let mut out = vec![];
        for plane in x.chunks(h * w) {
            for y in 0..oh {
                for xo in 0..ow {
                    let (h0, w0) = (
                        (y * p.stride[0]) as i64 - p.padding[0] as i64,
                        (xo * p.stride[1]) as i64 - p.padding[1] as i64,
                    );
                    let (h1, w1) = (
                        (h0 + p.kernel[0] as i64).min((h + p.padding[0]) as i64),
                        (w0 + p.kernel[1] as i64).min((w + p.padding[1]) as i64),
                    );
                    let (mut sum, mut count) = (0.0, 0);
                    for ih in h0.max(0)..h1.min(h as i64) {
                        for iw in w0.max(0)..w1.min(w as i64) {
                            sum += plane[(ih * w as i64 + iw) as usize];
                            count += 1;
                        }
                    }
                    out.push(sum / if include { ((h1 - h0) * (w1 - w0)) as f64 } else { count as f64 });
                }
            }
        }
        out
    }

    fn naive_adaptive(x: &[f64], h: usize, w: usize, oh: usize, ow: usize) -> Vec<f64> {
        let mut out = vec![];
        for plane in x.chunks(h * w) {
            for y in 0..oh {
                for xo in 0..ow {
                    let (h0, h1) = ((y * h) as f64 / oh as f64, ((y + 1) * h) as f64 / oh as f64);
                    let (w0, w1) = ((xo * w) as f64 / ow as f64, ((xo + 1) * w) as f64 / ow as f64);
                    let (h0, h1, w0, w1) =
                        (h0.floor() as usize, h1.ceil() as usize, w0.floor() as usize, w1.ceil() as usize);
                    let mut sum = 0.0;
                    for ih in h0..h1 {
                        for iw in w0..w1 {
                            sum += plane[ih * w + iw];
                        }
                    }
                    out.push(sum / ((h1 - h0) * (w1 - w0)) as f64);
                }
            }
        }
        out
    }

    fn pool_cases() -> Vec<([usize; 4], Pool2dParams)> {
        vec![
            ([2, 3, 6, 6], Pool2dParams::square(2)),
            ([2, 3, 7, 7], pool([3, 3], [2, 2], [1, 1], [1, 1], false)),
            ([2, 2, 5, 6], pool([3, 2], [1, 2], [0, 0], [1, 1], false)),
            ([1, 2, 7, 8], pool([3, 3], [2, 2], [1, 1], [1, 1], true)),
            ([1, 2, 6, 7], pool([2, 3], [3, 2], [1, 1], [1, 1], true)),
            ([2, 1, 9, 8], pool([3, 2], [2, 1], [1, 1], [2, 3], false)),
            ([1, 1, 9, 9], pool([2, 2], [2, 2], [1, 0], [2, 2], true)),
            ([3, 40, 20, 20], Pool2dParams::square(2)),
        ]
    }

    #[test]
    fn forward_matches_naive_loops() {
        let dev = Device::cpu();
        for (i, (xs, p)) in pool_cases().into_iter().enumerate() {
            let xv = distinct(i as u64, xs.iter().product());
            let x = leaf(&dev, &xv, &xs, false);
            let (out, ix) = max_pool2d_with_indices(&x, p).unwrap();
            let (oh, ow) = (out.shape()[2], out.shape()[3]);
            let (want, want_ix) = naive_max(&xv, xs[2], xs[3], p, oh, ow);
            assert_eq!(out.to_f64_vec().unwrap(), want, "max case {i}");
            assert_eq!(ix.to_vec::<i64>().unwrap(), want_ix, "max indices case {i}");
            let x32 = Tensor::from_slice(&dev, &xv.iter().map(|&v| v as f32).collect::<Vec<_>>(), &xs, Category::Input)
                .unwrap();
            let want32: Vec<f64> = want.iter().map(|&v| v as f32 as f64).collect();
            assert_eq!(max_pool2d(&x32, p).unwrap().to_f64_vec().unwrap(), want32, "f32 max case {i}");
            if p.dilation == [1, 1] {
                for include in [true, false] {
                    let got = avg_pool2d(&x, p, include).unwrap().to_f64_vec().unwrap();
                    let want = naive_avg(&xv, xs[2], xs[3], p, include, oh, ow);
                    for (a, b) in got.iter().zip(&want) {
                        assert!((a - b).abs() <= 1e-12 * (1.0 + b.abs()), "avg case {i} include {include}: {a} vs {b}");
                    }
                }
            }
        }
        for (xs, os) in [([2, 3, 5, 7], [2, 3]), ([1, 2, 6, 6], [4, 4]), ([1, 1, 3, 5], [5, 7]), ([1, 1, 5, 5], [1, 1])]
        {
            let xv = distinct(7, xs.iter().product());
            let x = leaf(&dev, &xv, &xs, false);
            let got = adaptive_avg_pool2d(&x, os).unwrap();
            assert_eq!(got.shape(), [xs[0], xs[1], os[0], os[1]]);
            let want = naive_adaptive(&xv, xs[2], xs[3], os[0], os[1]);
            for (a, b) in got.to_f64_vec().unwrap().iter().zip(&want) {
                assert!((a - b).abs() <= 1e-12 * (1.0 + b.abs()), "adaptive {xs:?} -> {os:?}: {a} vs {b}");
            }
        }
    }

    /// Checks the gradient of `sum(f(x) * r)` against central differences (f64).
    fn gradcheck(xv: &[f64], shape: &[usize], f: impl Fn(&Tensor) -> Result<Tensor>) {
        let dev = Device::cpu();
        let x = leaf(&dev, xv, shape, true);
        let out = f(&x).unwrap();
        let r = distinct(3, out.numel());
        backward_with(&out, Tensor::from_slice(&dev, &r, out.shape(), Category::Input).unwrap()).unwrap();
        let analytic = x.grad().unwrap().to_f64_vec().unwrap();
        let loss = |v: &[f64]| -> f64 {
            let t = leaf(&dev, v, shape, false);
            f(&t).unwrap().to_f64_vec().unwrap().iter().zip(&r).map(|(a, b)| a * b).sum()
        };
        let (eps, mut v) = (1e-6, xv.to_vec());
        for e in 0..v.len() {
            let orig = v[e];
            v[e] = orig + eps;
            let up = loss(&v);
            v[e] = orig - eps;
            let down = loss(&v);
            v[e] = orig;
            let numeric = (up - down) / (2.0 * eps);
            assert!(
                (analytic[e] - numeric).abs() <= 1e-6 * (1.0 + numeric.abs()),
                "element {e}: {} vs {numeric}",
                analytic[e]
            );
        }
    }

    #[test]
    fn gradients_match_finite_differences() {
        for (i, (xs, p)) in pool_cases().into_iter().enumerate().take(7) {
            let xv = distinct(50 + i as u64, xs.iter().product());
            gradcheck(&xv, &xs, |x| max_pool2d(x, p));
            if p.dilation == [1, 1] {
                gradcheck(&xv, &xs, |x| avg_pool2d(x, p, true));
                gradcheck(&xv, &xs, |x| avg_pool2d(x, p, false));
            }
        }
        // A window of more than 256 positions saves 2-byte positions.
        let xv = distinct(9, 2 * 18 * 18);
        gradcheck(&xv, &[1, 2, 18, 18], |x| max_pool2d(x, pool([17, 17], [1, 1], [0, 0], [1, 1], false)));
        for (xs, os) in [([2, 3, 5, 7], [2, 3]), ([1, 2, 6, 6], [4, 4]), ([1, 1, 3, 5], [5, 7])] {
            let xv = distinct(11, xs.iter().product());
            gradcheck(&xv, &xs, |x| adaptive_avg_pool2d(x, os));
        }
    }

    fn program(dev: &Device) -> Vec<(EventKind, u64, Category, &'static str, Phase)> {
        let x = Tensor::full(dev, &[2, 3, 9, 9], 0.5, DType::F32, Category::Input).unwrap().set_requires_grad(true);
        {
            let _phase = dev.enter_phase(Phase::Forward);
            let p = pool([3, 3], [2, 2], [1, 1], [1, 1], true);
            let (a, _ix) = max_pool2d_with_indices(&x, p).unwrap();
            let b = max_pool2d(&x, p).unwrap();
            let c = avg_pool2d(&x, p, false).unwrap();
            let d = adaptive_avg_pool2d(&x, [2, 3]).unwrap();
            for out in [a, b, c, d] {
                let seed = Tensor::full(dev, out.shape(), 1.0, DType::F32, Category::Temporary).unwrap();
                backward_with(&out, seed).unwrap();
            }
        }
        let events =
            dev.allocator().timeline().events().map(|e| (e.kind, e.bytes, e.category, e.op, e.phase)).collect();
        events
    }

    #[test]
    fn meta_allocates_what_cpu_allocates() {
        assert_eq!(program(&Device::cpu()), program(&Device::meta()));
    }

    #[test]
    fn max_pool_saves_one_byte_per_output() {
        let dev = Device::cpu();
        let x = Tensor::full(&dev, &[4, 8, 32, 32], 0.5, DType::F32, Category::Input).unwrap().set_requires_grad(true);
        let before = dev.stats().by_category[Category::Activation.index()].current;
        let out = max_pool2d(&x, Pool2dParams::square(2)).unwrap();
        // One u8 position per output (8192 bytes); no input and no i64 indices kept.
        let saved = dev.stats().by_category[Category::Activation.index()].current - before;
        assert_eq!(saved, out.numel() as u64);
        let allocs =
            dev.allocator().timeline().events().filter(|e| e.kind == EventKind::Alloc && e.op == "max_pool2d").count();
        assert_eq!(allocs, 2);
        drop(out);
        assert_eq!(dev.stats().by_category[Category::Activation.index()].current, before);
    }

    /// Positions are kept in the fewest bytes that count a window: 1 up to 256 positions, 2 up to
    /// 65536, else 4.
    #[test]
    fn saved_positions_widen_with_the_window() {
        let dev = Device::cpu();
        for (kernel, width) in [([16, 16], 1), ([16, 17], 2), ([256, 256], 2), ([256, 257], 4)] {
            // 512 windows down a column: 512 positions, a whole number of 512-byte blocks.
            let shape = [1, 1, kernel[0] + 511, kernel[1]];
            let x = Tensor::zeros(&dev, &shape, DType::F32, Category::Input).unwrap().set_requires_grad(true);
            let before = dev.stats().by_category[Category::Activation.index()].current;
            let out = max_pool2d(&x, pool(kernel, [1, 1], [0, 0], [1, 1], false)).unwrap();
            assert_eq!(out.numel(), 512);
            let saved = dev.stats().by_category[Category::Activation.index()].current - before;
            assert_eq!(saved, 512 * width, "window {kernel:?}");
        }
    }

    #[test]
    fn shape_errors_are_clear() {
        let dev = Device::cpu();
        let x = Tensor::zeros(&dev, &[1, 1, 4, 4], DType::F32, Category::Input).unwrap();
        let msg = |r: Result<Tensor>| r.unwrap_err().to_string();
        assert!(msg(max_pool2d(&x, pool([2, 2], [2, 2], [2, 0], [1, 1], false))).contains("half of the kernel"));
        assert!(msg(max_pool2d(&x, pool([5, 5], [1, 1], [0, 0], [1, 1], false))).contains("too small"));
        assert!(msg(max_pool2d(&x, pool([3, 3], [1, 1], [0, 0], [2, 2], false))).contains("too small"));
        // Too small in one dim only; an output of width 1 is fine.
        let narrow = Tensor::zeros(&dev, &[1, 1, 4, 2], DType::F32, Category::Input).unwrap();
        assert!(msg(max_pool2d(&narrow, pool([1, 3], [1, 1], [0, 0], [1, 1], false))).contains("too small"));
        let three = Tensor::zeros(&dev, &[1, 1, 4, 3], DType::F32, Category::Input).unwrap();
        assert_eq!(max_pool2d(&three, pool([1, 3], [1, 1], [0, 0], [1, 1], false)).unwrap().shape(), [1, 1, 4, 1]);
        assert!(msg(max_pool2d(&x, pool([2, 2], [0, 2], [0, 0], [1, 1], false))).contains("stride"));
        assert!(msg(avg_pool2d(&x, pool([0, 2], [1, 1], [0, 0], [1, 1], false), true)).contains("kernel"));
        assert!(msg(adaptive_avg_pool2d(&x, [0, 2])).contains("output size"));
        for shape in [[1, 1, 0, 4], [1, 1, 4, 0]] {
            let empty = Tensor::zeros(&dev, &shape, DType::F32, Category::Input).unwrap();
            assert!(msg(max_pool2d(&empty, Pool2dParams::square(1))).contains("empty spatial dim"), "{shape:?}");
        }
        let flat = Tensor::zeros(&dev, &[4, 4], DType::F32, Category::Input).unwrap();
        assert!(msg(max_pool2d(&flat, Pool2dParams::square(2))).contains("[N, C, H, W]"));
        let ints = Tensor::from_slice(&dev, &[0i64; 16], &[1, 1, 4, 4], Category::Input).unwrap();
        assert!(max_pool2d(&ints, Pool2dParams::square(2)).is_err());
    }

    #[test]
    fn matches_pytorch_golden_data() {
        let dir = std::path::PathBuf::from(crate::ops::softmax::test_support::GOLDEN_DIR);
        assert!(dir.join("manifest.json").exists(), "golden data missing at {}", dir.display());
        let manifest: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.join("manifest.json")).unwrap()).unwrap();
        let bytes = std::fs::read(dir.join("pool.safetensors")).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let values = |key: &str| -> (Vec<f64>, Vec<usize>) {
            let v = st.tensor(key).unwrap_or_else(|e| panic!("{key}: {e}"));
            let d = v.data();
            let vals = match v.dtype() {
                safetensors::Dtype::F32 => {
                    d.chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap()) as f64).collect()
                }
                safetensors::Dtype::F64 => {
                    d.chunks_exact(8).map(|b| f64::from_le_bytes(b.try_into().unwrap())).collect()
                }
                safetensors::Dtype::I64 => {
                    d.chunks_exact(8).map(|b| i64::from_le_bytes(b.try_into().unwrap()) as f64).collect()
                }
                other => panic!("{key}: unexpected dtype {other:?}"),
            };
            (vals, v.shape().to_vec())
        };
        let dev = Device::cpu();
        let tensor = |key: &str, dtype: DType| {
            let (v, s) = values(key);
            if dtype == DType::F32 {
                Tensor::from_slice(&dev, &v.iter().map(|&x| x as f32).collect::<Vec<_>>(), &s, Category::Input).unwrap()
            } else {
                Tensor::from_slice(&dev, &v, &s, Category::Input).unwrap()
            }
        };
        let within = |got: &[f64], want: &[f64], rtol: f64, what: &str| {
            assert_eq!(got.len(), want.len(), "{what}");
            let atol = rtol * want.iter().fold(0.0f64, |m, v| m.max(v.abs()));
            for (i, (g, w)) in got.iter().zip(want).enumerate() {
                assert!((g - w).abs() <= rtol * w.abs() + atol, "{what}[{i}]: got {g}, want {w}");
            }
        };
        let mut seen = 0;
        for case in manifest["cases"].as_array().unwrap() {
            if case["file"] != "pool.safetensors" {
                continue;
            }
            let name = case["name"].as_str().unwrap();
            let (dtype, rtol) = if case["dtype"] == "float32" { (DType::F32, 1e-5) } else { (DType::F64, 1e-10) };
            let a = &case["attrs"];
            let pair = |k: &str, default: usize| {
                if a[k].is_array() {
                    [a[k][0].as_u64().unwrap() as usize, a[k][1].as_u64().unwrap() as usize]
                } else {
                    [default, default]
                }
            };
            let x = tensor(&format!("{name}/input"), dtype).set_requires_grad(true);
            let mut indices = None;
            let out = match case["op"].as_str().unwrap() {
                "adaptive_avg_pool2d" => adaptive_avg_pool2d(&x, pair("output_size", 1)).unwrap(),
                op => {
                    let p = pool(
                        pair("kernel_size", 1),
                        pair("stride", 1),
                        pair("padding", 0),
                        pair("dilation", 1),
                        a["ceil_mode"] == true,
                    );
                    if op == "max_pool2d" {
                        let (out, ix) = max_pool2d_with_indices(&x, p).unwrap();
                        indices = Some(ix);
                        out
                    } else {
                        assert!(a["divisor_override"].is_null(), "{name}");
                        avg_pool2d(&x, p, a["count_include_pad"] != false).unwrap()
                    }
                }
            };
            within(&out.to_f64_vec().unwrap(), &values(&format!("{name}/output")).0, rtol, name);
            if let Some(ix) = indices {
                assert_eq!(ix.to_f64_vec().unwrap(), values(&format!("{name}/indices")).0, "{name} indices");
            }
            backward_with(&out, tensor(&format!("{name}/grad_out"), dtype)).unwrap();
            within(
                &x.grad().unwrap().to_f64_vec().unwrap(),
                &values(&format!("{name}/grad_input")).0,
                rtol,
                &format!("{name} grad"),
            );
            seen += 1;
        }
        assert!(seen >= 18, "only {seen} pool golden cases");
    }
}
