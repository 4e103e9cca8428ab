//! Matrix products: `matmul` (2-D, batched, broadcast batch dims), `linear` (PyTorch's
//! `x W^T + b`) and `gelu_linear` (`linear(gelu(x))` fused, saving only GELU's input). Products run on
//! `memfit-kernels`' GEMM, which takes arbitrary strides, so transposed views are multiplied without
//! copies.

use crate::backend::cpu::elementwise::{gelu_backward_over_input, gelu_backward_slice, gelu_slice, gelu_with_derivative_slice, par_update, par_zip};
use super::{check_same, output, sum_to_shape};
use crate::backend::cpu::gemm::{gemm_into, Mat, SendPtr, GEMM_PARALLEL_WORK};
use crate::autograd::{needs_grad, record, save, Backward};
use crate::dtype::Float;
use crate::error::{Error, Result};
use crate::layout::{broadcast_layout, broadcast_shapes, Layout};
use crate::tensor::Tensor;
use crate::with_float;
use memfit_memory::Category;
use rayon::prelude::*;

/// The operand view of the last two dims of `t` at element offset `offset`.
fn mat_of<T>(base: *const T, l: &Layout, offset: usize) -> Mat<T> {
    let r = l.rank();
    // SAFETY: offset is inside the storage (computed from the layout).
    Mat { ptr: unsafe { base.add(offset) }, rs: l.strides()[r - 2] as isize, cs: l.strides()[r - 1] as isize }
}

/// Offsets of every batch matrix of a broadcast layout (all dims but the last two).
fn batch_offsets(l: &Layout) -> Vec<usize> {
    let r = l.rank();
    let batch = Layout::new(l.shape()[..r - 2].to_vec(), l.strides()[..r - 2].to_vec(), l.offset());
    let mut out = Vec::with_capacity(batch.numel());
    batch.for_each_offset(|o| out.push(o));
    out
}

fn matmul_kernel(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    check_same("matmul", &[a, b])?;
    if a.rank() < 2 || b.rank() < 2 {
        return Err(Error::shape(format!(
            "matmul needs operands of rank >= 2, got {:?} and {:?} (unsqueeze vectors first)",
            a.shape(),
            b.shape()
        )));
    }
    let (ra, rb) = (a.rank(), b.rank());
    let (m, k, k2, n) = (a.shape()[ra - 2], a.shape()[ra - 1], b.shape()[rb - 2], b.shape()[rb - 1]);
    if k != k2 {
        return Err(Error::shape(format!("matmul: {:?} @ {:?}: inner dims {k} and {k2} differ", a.shape(), b.shape())));
    }
    let batch = broadcast_shapes(&a.shape()[..ra - 2], &b.shape()[..rb - 2])?;
    let mut shape = batch.clone();
    shape.extend([m, n]);
    let out = output(a, &shape, a.dtype(), "matmul")?;
    if !a.device().computes() {
        return Ok(out);
    }
    let mut sa = batch.clone();
    sa.extend([m, k]);
    let mut sb = batch;
    sb.extend([k, n]);
    let (la, lb) = (broadcast_layout(a.layout(), &sa), broadcast_layout(b.layout(), &sb));
    let (oa, ob) = (batch_offsets(&la), batch_offsets(&lb));
    with_float!(a.dtype(), "matmul", T => {
        let pa = SendPtr(a.storage_ptr()? as *mut T);
        let pb = SendPtr(b.storage_ptr()? as *mut T);
        let dst = SendPtr(out.slice_mut::<T>()?.as_mut_ptr());
        let threads = rayon::current_num_threads();
        let run = |i: usize, threads: usize| {
            let (d, pa, pb) = (dst, pa, pb);
            // SAFETY: batch i writes its own m x n block of the fresh output; operands are in bounds.
            unsafe {
                gemm_into::<T>(m, n, k, d.0.add(i * m * n), n as isize, false,
                    mat_of(pa.0 as *const T, &la, oa[i]), mat_of(pb.0 as *const T, &lb, ob[i]), threads)
            }
        };
        if oa.len() > 1 && m * n * k < GEMM_PARALLEL_WORK {
            (0..oa.len()).into_par_iter().for_each(|i| run(i, 1));
        } else {
            (0..oa.len()).for_each(|i| run(i, threads));
        }
    });
    Ok(out)
}

impl Tensor {
    /// Matrix product over the last two dims, broadcasting batch dims.
    pub fn matmul(&self, other: &Tensor) -> Result<Tensor> {
        let _op = self.device().op_scope("matmul");
        let out = matmul_kernel(self, other)?;
        if !needs_grad(&[self, other]) {
            return Ok(out);
        }
        let back = MatmulBack { a: save(self), b: save(other) };
        Ok(record(out, "matmul", &[self, other], back))
    }
}

struct MatmulBack {
    a: Tensor,
    b: Tensor,
}

impl Backward for MatmulBack {
    fn backward(self: Box<Self>, grad: Tensor, needs: &[bool]) -> Result<Vec<Option<Tensor>>> {
        let ga = if needs[0] {
            Some(sum_to_shape(&matmul_kernel(&grad, &self.b.transpose(-2, -1)?)?, self.a.shape())?)
        } else {
            None
        };
        let gb = if needs[1] {
            Some(sum_to_shape(&matmul_kernel(&self.a.transpose(-2, -1)?, &grad)?, self.b.shape())?)
        } else {
            None
        };
        Ok(vec![ga, gb])
    }
}

/// Checks `linear`'s operands (x [..., in], weight [out, in], bias [out]); returns (out, in).
pub(crate) fn check_linear(op: &str, x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Result<(usize, usize)> {
    let mut all = vec![x, weight];
    all.extend(bias);
    check_same(op, &all)?;
    if x.rank() < 1 || weight.rank() != 2 {
        return Err(Error::shape(format!("{op}: input {:?}, weight {:?}", x.shape(), weight.shape())));
    }
    let (out_f, in_f) = (weight.shape()[0], weight.shape()[1]);
    if x.shape()[x.rank() - 1] != in_f {
        return Err(Error::shape(format!(
            "{op}: input has {} features but the weight {:?} expects {in_f}",
            x.shape()[x.rank() - 1],
            weight.shape()
        )));
    }
    if let Some(b) = bias {
        if b.shape() != [out_f] {
            return Err(Error::shape(format!("{op}: bias {:?} should be [{out_f}]", b.shape())));
        }
    }
    Ok((out_f, in_f))
}

/// The weight [out, in] as a GEMM operand: transposed ([in, out], for `x W^T`) or as stored.
pub(crate) fn weight_mat<T>(weight: &Tensor, transposed: bool) -> Result<Mat<T>> {
    let w = weight.layout();
    // SAFETY: the offset comes from the weight's layout.
    let ptr = unsafe { (weight.storage_ptr()? as *const T).add(w.offset()) };
    let (s0, s1) = (w.strides()[0] as isize, w.strides()[1] as isize);
    Ok(if transposed { Mat { ptr, rs: s1, cs: s0 } } else { Mat { ptr, rs: s0, cs: s1 } })
}

/// Starts a linear layer's output: every row of `dst` (rows of `out_f`) is the bias, when there is
/// one (the GEMM then accumulates into it). Shared by `linear`, `gelu_linear` and `layer_norm_linear`.
pub(crate) fn fill_rows_with_bias<T: Float + crate::tensor::Element>(
    dst: &mut [T],
    bias: Option<&Tensor>,
    out_f: usize,
) -> Result<()> {
    if let Some(b) = bias {
        let b = b.contiguous()?;
        let bv = b.slice::<T>()?;
        dst.chunks_mut(out_f).for_each(|r| r.copy_from_slice(bv));
    }
    Ok(())
}

/// `x W^T + b` over the last dim of `x` (PyTorch's `F.linear`): x [..., in], weight [out, in], bias [out].
pub fn linear(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    let _op = x.device().op_scope("linear");
    let (out_f, in_f) = check_linear("linear", x, weight, bias)?;
    let x = x.contiguous()?;
    let rows = x.numel() / in_f.max(1);
    let mut shape = x.shape().to_vec();
    *shape.last_mut().expect("rank >= 1") = out_f;
    let out = output(&x, &shape, x.dtype(), "linear")?;
    if x.device().computes() {
        with_float!(x.dtype(), "linear", T => {
            let dst = out.slice_mut::<T>()?;
            fill_rows_with_bias::<T>(dst, bias, out_f)?;
            // W^T as a [in, out] operand: element (i, o) is W[o, i].
            let wt = weight_mat::<T>(weight, true)?;
            let xs = Mat { ptr: x.slice::<T>()?.as_ptr(), rs: in_f as isize, cs: 1 };
            // SAFETY: fresh output of rows x out_f; operands valid for their layouts.
            unsafe { gemm_into::<T>(rows, out_f, in_f, dst.as_mut_ptr(), out_f as isize, bias.is_some(), xs, wt, rayon::current_num_threads()) };
        });
    }
    let mut inputs = vec![&x, weight];
    inputs.extend(bias);
    if !needs_grad(&inputs) {
        return Ok(out);
    }
    let back = LinearBack { x: save(&x), weight: save(weight), has_bias: bias.is_some() };
    Ok(record(out, "linear", &inputs, back))
}

struct LinearBack {
    x: Tensor,
    weight: Tensor,
    has_bias: bool,
}

impl Backward for LinearBack {
    fn backward(self: Box<Self>, grad: Tensor, needs: &[bool]) -> Result<Vec<Option<Tensor>>> {
        let (out_f, in_f) = (self.weight.shape()[0], self.weight.shape()[1]);
        let g2 = grad.contiguous()?.reshape(&[-1, out_f as isize])?;
        let x2 = self.x.reshape(&[-1, in_f as isize])?;
        let gx = if needs[0] {
            let gx = matmul_kernel(&g2, &self.weight)?;
            let shape: Vec<isize> = self.x.shape().iter().map(|&d| d as isize).collect();
            Some(gx.reshape(&shape)?)
        } else {
            None
        };
        let gw = if needs[1] { Some(matmul_kernel(&g2.transpose(0, 1)?, &x2)?) } else { None };
        let mut grads = vec![gx, gw];
        if self.has_bias {
            grads.push(if needs[2] { Some(g2.sum_dim(0, false)?) } else { None });
        }
        Ok(grads)
    }
}

/// Rows [`gelu_linear`] runs per block (its scratch holds GELU_ROWS rows of the input).
const GELU_ROWS: usize = 512;

/// `linear(gelu(x), weight, bias)` with the exact (erf) GELU, fused (a transformer MLP's second layer
/// with its activation): x [..., in], weight [out, in], bias [out].
///
/// Unfused, autograd keeps both GELU's input (for GELU's backward) and its output (for the linear's);
/// this op saves only `x` and the weight, and recomputes GELU in backward (from the same one erf per
/// element that an unfused backward spends on GELU's derivative). Forward and backward work in blocks
/// of `GELU_ROWS` rows through an allocator scratch of one block (two in a backward that cannot write
/// over `x`), so GELU's output never exists whole. Backward writes the input gradient over the saved
/// `x` when nobody else can see it (Note [Gradient ownership] in `autograd.rs`), else into a new
/// tensor. GELU values and derivatives are computed exactly as [`Tensor::gelu`] computes them; only
/// the weight gradient's sum over rows is split by blocks.
pub fn gelu_linear(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    let _op = x.device().op_scope("gelu_linear");
    let (out_f, in_f) = check_linear("gelu_linear", x, weight, bias)?;
    let x = x.contiguous()?;
    let rows = x.numel() / in_f.max(1);
    let mut shape = x.shape().to_vec();
    *shape.last_mut().expect("rank >= 1") = out_f;
    let out = output(&x, &shape, x.dtype(), "gelu_linear")?;
    let scratch = output(&x, &[rows.min(GELU_ROWS), in_f], x.dtype(), "gelu_linear")?;
    if x.device().computes() {
        with_float!(x.dtype(), "gelu_linear", T => {
            let dst = out.slice_mut::<T>()?;
            fill_rows_with_bias::<T>(dst, bias, out_f)?;
            let wt = weight_mat::<T>(weight, true)?;
            let (xs, sc) = (x.slice::<T>()?, scratch.slice_mut::<T>()?);
            for r0 in (0..rows).step_by(GELU_ROWS) {
                let n = GELU_ROWS.min(rows - r0);
                gelu_slice(&xs[r0 * in_f..(r0 + n) * in_f], &mut sc[..n * in_f]);
                let a = Mat { ptr: sc.as_ptr(), rs: in_f as isize, cs: 1 };
                // SAFETY: rows r0..r0+n of the fresh output; the scratch is a separate tensor.
                unsafe {
                    gemm_into::<T>(n, out_f, in_f, dst.as_mut_ptr().add(r0 * out_f), out_f as isize, bias.is_some(),
                        a, wt, rayon::current_num_threads())
                };
            }
        });
    }
    drop(scratch);
    let mut inputs = vec![&x, weight];
    inputs.extend(bias);
    if !needs_grad(&inputs) {
        return Ok(out);
    }
    let back = GeluLinearBack { x: save(&x), weight: save(weight), has_bias: bias.is_some() };
    Ok(record(out, "gelu_linear", &inputs, back))
}

struct GeluLinearBack {
    /// GELU's input; overwritten with its gradient in backward when exclusively owned.
    x: Tensor,
    weight: Tensor,
    has_bias: bool,
}

impl Backward for GeluLinearBack {
    fn backward(self: Box<Self>, grad: Tensor, needs: &[bool]) -> Result<Vec<Option<Tensor>>> {
        const NAME: &str = "gelu_linear_backward";
        let GeluLinearBack { x, weight, has_bias } = *self;
        let (out_f, in_f) = (weight.shape()[0], weight.shape()[1]);
        let g2 = grad.contiguous()?.reshape(&[-1, out_f as isize])?;
        let rows = g2.shape()[0];
        // Decided from who holds what, never from data, so meta allocates as cpu does.
        let in_place = needs[0] && x.owns_storage();
        let gx = if needs[0] && !in_place { Some(output(&grad, x.shape(), grad.dtype(), NAME)?) } else { None };
        let gw = if needs[1] { Some(output(&grad, &[out_f, in_f], grad.dtype(), NAME)?) } else { None };
        let gb = if has_bias && needs[2] { Some(g2.sum_dim(0, false)?) } else { None };
        // Everything is allocated before x may be overwritten. With both gradients wanted, a block's
        // GELU output and derivative come from one erf per element (as in an unfused backward): the
        // derivative goes over x's block when in place, else into a second half of the scratch.
        let both = needs[0] && needs[1];
        let block = rows.min(GELU_ROWS);
        let scratch_rows = if both && !in_place { 2 * block } else { block };
        let scratch = output(&grad, &[scratch_rows, in_f], grad.dtype(), NAME)?;
        if grad.device().computes() {
            with_float!(grad.dtype(), NAME, T => {
                let gs = g2.slice::<T>()?;
                // In place, the input gradient is x itself: reads of a block of x finish before the
                // block is overwritten.
                let xp = x.slice_mut::<T>()?.as_mut_ptr();
                let gxp = match &gx {
                    Some(t) => Some(t.slice_mut::<T>()?.as_mut_ptr()),
                    None if in_place => Some(xp),
                    None => None,
                };
                let gwp = gw.as_ref().map(|t| t.slice_mut::<T>()).transpose()?;
                if rows == 0 {
                    if let Some(gw) = gwp {
                        gw.fill(<T as Float>::of(0.0));
                    }
                } else {
                    let gwp = gwp.map(|s| s.as_mut_ptr());
                    let (sc, deriv) = scratch.slice_mut::<T>()?.split_at_mut(block * in_f);
                    let w = weight_mat::<T>(&weight, false)?;
                    let threads = rayon::current_num_threads();
                    for r0 in (0..rows).step_by(GELU_ROWS) {
                        let n = GELU_ROWS.min(rows - r0);
                        let len = n * in_f;
                        // SAFETY: block r0..r0+n of x, gx and grad is in bounds; the scratch and gw are
                        // separate tensors; no slice of the block outlives the writes below.
                        unsafe {
                            let xb = xp.add(r0 * in_f);
                            if let (Some(gwp), Some(gxp)) = (gwp, gxp) {
                                // gelu(x) and gelu'(x) in one pass; dW (+)= g_block^T gelu(x_block); then
                                // dx = (g_block W) * gelu'(x_block), over x's block when in place.
                                let y = &mut sc[..len];
                                if in_place {
                                    // x_block -> (y, gelu'(x)) with gelu'(x) over x_block.
                                    gelu_with_derivative_slice(y, std::slice::from_raw_parts_mut(xb, len));
                                } else {
                                    let xr = std::slice::from_raw_parts(xb as *const T, len);
                                    let d = &mut deriv[..len];
                                    d.copy_from_slice(xr);
                                    gelu_with_derivative_slice(y, d);
                                }
                                let gt = Mat { ptr: gs.as_ptr().add(r0 * out_f), rs: 1, cs: out_f as isize };
                                let a = Mat { ptr: sc.as_ptr(), rs: in_f as isize, cs: 1 };
                                gemm_into::<T>(out_f, in_f, n, gwp, in_f as isize, r0 > 0, gt, a, threads);
                                let g_rows = Mat { ptr: gs.as_ptr().add(r0 * out_f), rs: out_f as isize, cs: 1 };
                                gemm_into::<T>(n, in_f, out_f, sc.as_mut_ptr(), in_f as isize, false, g_rows, w, threads);
                                let dst = std::slice::from_raw_parts_mut(gxp.add(r0 * in_f), len);
                                if in_place {
                                    par_update(&sc[..len], dst, |g, d| g * d);
                                } else {
                                    par_zip(&sc[..len], &deriv[..len], dst, |g, d| g * d);
                                }
                                continue;
                            }
                            if let Some(gwp) = gwp {
                                // dW (+)= g_block^T gelu(x_block)
                                gelu_slice(std::slice::from_raw_parts(xb, len), &mut sc[..len]);
                                let gt = Mat { ptr: gs.as_ptr().add(r0 * out_f), rs: 1, cs: out_f as isize };
                                let a = Mat { ptr: sc.as_ptr(), rs: in_f as isize, cs: 1 };
                                gemm_into::<T>(out_f, in_f, n, gwp, in_f as isize, r0 > 0, gt, a, threads);
                            }
                            if let Some(gxp) = gxp {
                                // dx = (g_block W) * gelu'(x_block)
                                let g_rows = Mat { ptr: gs.as_ptr().add(r0 * out_f), rs: out_f as isize, cs: 1 };
                                gemm_into::<T>(n, in_f, out_f, sc.as_mut_ptr(), in_f as isize, false, g_rows, w, threads);
                                if in_place {
                                    let xm = std::slice::from_raw_parts_mut(xb, len);
                                    gelu_backward_over_input(&sc[..len], xm);
                                } else {
                                    let xr = std::slice::from_raw_parts(xb as *const T, len);
                                    let dst = std::slice::from_raw_parts_mut(gxp.add(r0 * in_f), len);
                                    gelu_backward_slice(xr, &sc[..len], dst);
                                }
                            }
                        }
                    }
                }
            });
        }
        drop(scratch);
        let gx = if in_place {
            // x now holds its gradient: a temporary again, no longer an activation.
            x.storage().set_category(Category::Temporary);
            Some(x)
        } else {
            gx
        };
        let mut grads = vec![gx, gw];
        if has_bias {
            grads.push(gb);
        }
        Ok(grads)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::autograd::backward_with;
    use crate::ops::softmax::test_support::*;
    use crate::{Category, DType, Device};

    /// gelu_linear against `linear(x.gelu())`: output and every gradient, with the input a leaf (a
    /// new gradient tensor) or produced by an op (its gradient written over the saved input).
    #[test]
    fn gelu_linear_matches_composed_ops() {
        let dev = Device::cpu();
        // Several blocks of rows, the last one partial.
        let (rows, i, o) = (2 * GELU_ROWS + 105, 16, 12);
        for dtype in [DType::F64, DType::F32] {
            let tol = if dtype == DType::F64 { 1e-12 } else { 1e-5 };
            let leaf = |n, salt, shape: &[usize]| {
                let v: Vec<f64> = values(n, salt).iter().map(|v| v * 3.0).collect();
                t64(&dev, &v, shape).to_dtype(dtype).unwrap().set_requires_grad(true)
            };
            let x = leaf(rows * i, 1, &[rows, i]);
            let (w, b) = (leaf(o * i, 2, &[o, i]), leaf(o, 3, &[o]));
            let g = t64(&dev, &values(rows * o, 4), &[rows, o]).to_dtype(dtype).unwrap();
            for produced in [false, true] {
                let input = if produced { x.mul_scalar(1.0).unwrap() } else { x.clone() };
                let y = gelu_linear(&input, &w, Some(&b)).unwrap();
                drop(input);
                backward_with(&y, g.clone()).unwrap();
                let got: Vec<Vec<f64>> =
                    [&x, &w, &b].iter().map(|t| t.take_grad().unwrap().to_f64_vec().unwrap()).collect();
                let r = linear(&x.gelu().unwrap(), &w, Some(&b)).unwrap();
                assert_close(&y.to_f64_vec().unwrap(), &r.to_f64_vec().unwrap(), tol, "output");
                backward_with(&r, g.clone()).unwrap();
                for (k, t) in [&x, &w, &b].iter().enumerate() {
                    assert_close(&got[k], &t.take_grad().unwrap().to_f64_vec().unwrap(), tol, "gradient");
                }
            }
        }
    }

    #[test]
    fn gelu_linear_saves_only_its_input_and_reuses_it() {
        let dev = Device::cpu();
        let x = Tensor::from_slice(&dev, &values(300 * 64, 1), &[300, 64], Category::Input)
            .unwrap()
            .set_requires_grad(true);
        let w =
            Tensor::from_slice(&dev, &values(8 * 64, 2), &[8, 64], Category::Input).unwrap().set_requires_grad(true);
        let h = x.mul_scalar(1.0).unwrap(); // a temporary of 300 x 64 f64 = 150 KiB
        let activation = || dev.stats().category(Category::Activation).current;
        let y = gelu_linear(&h, &w, None).unwrap();
        drop(h);
        assert_eq!(activation(), 300 * 64 * 8, "only GELU's input is saved (the weight is an input)");
        let g = t64(&dev, &values(300 * 8, 3), &[300, 8]);
        let before = dev.allocator().timeline().events().count();
        backward_with(&y, g).unwrap();
        let a = dev.allocator();
        let allocs: Vec<(u64, &str)> = a
            .timeline()
            .events()
            .skip(before)
            .filter(|e| e.kind == memfit_memory::EventKind::Alloc)
            .map(|e| (e.bytes, e.op))
            .collect();
        // The weight gradient and a scratch of one block of rows (GELU's output, then the gradient
        // before GELU; its derivative goes over the saved input, which becomes dx); then the affine's
        // backward (its own output).
        let block = (300.min(GELU_ROWS) * 64 * 8) as u64;
        assert_eq!(allocs[..2], [(4096, "gelu_linear_backward"), (block, "gelu_linear_backward")]);
        assert_eq!(allocs.len(), 3, "{allocs:?}");
        assert_eq!(a.stats().category(Category::Activation).current, 0);
    }

    #[test]
    fn gelu_linear_meta_allocates_like_cpu() {
        assert_meta_matches_cpu(|dev| {
            let t = |shape: &[usize]| -> Result<Tensor> {
                Ok(Tensor::full(dev, shape, 0.1, DType::F32, Category::Input)?.set_requires_grad(true))
            };
            let (x, w, b) = (t(&[3, 100, 8])?, t(&[5, 8])?, t(&[5])?);
            // Leaf input (new gradient) and an intermediate one (gradient in place).
            let y = gelu_linear(&x, &w, Some(&b))?;
            crate::autograd::backward(&y.sum_all()?)?;
            let y = gelu_linear(&x.mul_scalar(2.0)?, &w, None)?;
            crate::autograd::backward(&y.sum_all()?)
        });
    }
}
