//! Matrix products: `matmul` (2-D, batched, broadcast batch dims), `linear` (PyTorch's
//! `x W^T + b`) and `gelu_linear` (`linear(gelu(x))` fused, saving only GELU's input). Products run on
//! `memfit-kernels`' GEMM, which takes arbitrary strides, so transposed views are multiplied without
//! copies. This file holds shapes, outputs (and the fused op's scratch) and autograd; the kernels are
//! the backend's (`memfit-cpu`'s `matmul.rs`).

use super::{check_same, output, sum_to_shape};
use crate::autograd::{needs_grad, record, save, save_compact, Backward, Compact};
use crate::error::{Error, Result};
use crate::layout::broadcast_shapes;
use crate::tensor::Tensor;
pub(crate) use memfit_cpu::matmul::{gelu_scratch_stride, GELU_ROWS};
use memfit_memory::Category;

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
    let mut shape = broadcast_shapes(&a.shape()[..ra - 2], &b.shape()[..rb - 2])?;
    shape.extend([m, n]);
    let out = output(a, &shape, a.dtype(), "matmul")?;
    a.device().backend().matmul(a, b, &out, super::products_of(a))?;
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
        let back = MatmulBack { a: save_compact(self)?, b: save_compact(other)? };
        Ok(record(out, "matmul", &[self, other], back))
    }
}

struct MatmulBack {
    a: Compact,
    b: Compact,
}

impl Backward for MatmulBack {
    fn backward(self: Box<Self>, grad: Tensor, needs: &[bool]) -> Result<Vec<Option<Tensor>>> {
        let ga = if needs[0] {
            Some(sum_to_shape(&matmul_kernel(&grad, &self.b.restore()?.transpose(-2, -1)?)?, self.a.shape())?)
        } else {
            None
        };
        let gb = if needs[1] {
            Some(sum_to_shape(&matmul_kernel(&self.a.restore()?.transpose(-2, -1)?, &grad)?, self.b.shape())?)
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

/// The bias as the kernels read it: contiguous. Called right after the op's outputs are allocated,
/// which is where the CPU kernels used to make this copy (for a non-contiguous bias), so cpu
/// allocates as before and meta now as cpu; the caller drops it right after the kernel.
pub(crate) fn contiguous_bias(bias: Option<&Tensor>) -> Result<Option<Tensor>> {
    bias.map(|b| b.contiguous()).transpose()
}

/// `x W^T + b` over the last dim of `x` (PyTorch's `F.linear`): x [..., in], weight [out, in], bias [out].
pub fn linear(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    let _op = x.device().op_scope("linear");
    let (out_f, _) = check_linear("linear", x, weight, bias)?;
    let x = x.contiguous()?;
    let mut shape = x.shape().to_vec();
    *shape.last_mut().expect("rank >= 1") = out_f;
    let out = output(&x, &shape, x.dtype(), "linear")?;
    let b = contiguous_bias(bias)?;
    x.device().backend().linear(&x, weight, b.as_ref(), &out, super::products_of(&x))?;
    drop(b);
    let mut inputs = vec![&x, weight];
    inputs.extend(bias);
    if !needs_grad(&inputs) {
        return Ok(out);
    }
    let back = LinearBack { x: save_compact(&x)?, weight: save(weight), has_bias: bias.is_some() };
    Ok(record(out, "linear", &inputs, back))
}

struct LinearBack {
    x: Compact,
    weight: Tensor,
    has_bias: bool,
}

impl Backward for LinearBack {
    fn backward(self: Box<Self>, grad: Tensor, needs: &[bool]) -> Result<Vec<Option<Tensor>>> {
        let (out_f, in_f) = (self.weight.shape()[0], self.weight.shape()[1]);
        let g2 = grad.contiguous()?.reshape(&[-1, out_f as isize])?;
        let products = super::products_of(&g2);
        let backend = g2.device().backend();
        // With the weight gradient wanted too, the input gradient is allocated here (as the
        // product would allocate it) and computed with it, from one rounding of g2 on a GPU.
        let both = needs[0] && needs[1];
        let gx2 = match (needs[0], both) {
            (false, _) => None,
            (true, true) => Some(output(&g2, &[g2.shape()[0], in_f], g2.dtype(), "matmul")?),
            (true, false) => Some(matmul_kernel(&g2, &self.weight)?),
        };
        let gw = if needs[1] { Some(output(&g2, &[out_f, in_f], g2.dtype(), "linear_backward")?) } else { None };
        let gb = bias_grad(&g2, self.has_bias && needs[2], gw.is_some(), "linear_backward")?;
        if let Some(gw) = &gw {
            let x = if reads_saved_operand(&self.x, &g2) { self.x.stored().clone() } else { self.x.restore()? };
            let x2 = x.reshape(&[-1, in_f as isize])?.contiguous()?;
            match &gx2 {
                Some(gx2) => backend.linear_backward(&g2, &x2, &self.weight, gx2, gw, gb.as_ref(), products)?,
                None => backend.linear_weight_grad(&g2, &x2, gw, gb.as_ref(), products)?,
            }
        }
        let shape: Vec<isize> = self.x.shape().iter().map(|&d| d as isize).collect();
        let gx = gx2.map(|gx| gx.reshape(&shape)).transpose()?;
        let mut grads = vec![gx, gw];
        if self.has_bias {
            grads.push(gb);
        }
        Ok(grads)
    }
}

/// Whether a linear layer's backward hands its saved input `x` to the weight gradient as saved, in
/// 16 bits, rather than restored to f32: on a GPU target, where x is saved in the format its f32
/// gradient's products round to, the saved bits are the operand bits that rounding the restored x
/// would give (Note [Half-precision storage]: the same rounding), so nothing is restored or rounded.
/// One exception, bf16's subnormals (|x| < 2^-126): storage keeps them, a bf16 operand is flushed to
/// a zero of its sign (Note [bf16 products] in memfit-kernels), so such an element enters the
/// product as itself instead of zero, a term below 2^-126 |w| in an f32 sum.
fn reads_saved_operand(x: &Compact, g: &Tensor) -> bool {
    super::saved_in_operand_format(x, g)
}

/// A linear layer's bias gradient from its output gradient `g2` [rows, out], when `wanted`: a fresh
/// output that the weight-gradient kernel fills when it runs (`with_weight`; it sums `g2`'s columns
/// as it reads `g2` for the weight gradient), else `g2`'s column sums.
pub(crate) fn bias_grad(g2: &Tensor, wanted: bool, with_weight: bool, op: &'static str) -> Result<Option<Tensor>> {
    match (wanted, with_weight) {
        (false, _) => Ok(None),
        (true, true) => Ok(Some(output(g2, &[g2.shape()[1]], g2.dtype(), op)?)),
        (true, false) => Ok(Some(g2.sum_dim(0, false)?)),
    }
}

/// `linear(gelu(x), weight, bias)` with the exact (erf) GELU, fused (a transformer MLP's second layer
/// with its activation): x [..., in], weight [out, in], bias [out].
///
/// Unfused, autograd keeps both GELU's input (for GELU's backward) and its output (for the linear's);
/// this op saves only `x` and the weight, and recomputes GELU in backward (from the same one erf per
/// element that an unfused backward spends on GELU's derivative). Forward and backward work in blocks
/// of `GELU_ROWS` rows (on a GPU, `GPU_FUSED_ROWS`) through an allocator scratch of one block (two in a backward that cannot write
/// over `x`), so GELU's output never exists whole. Backward writes the input gradient over the saved
/// `x` when nobody else can see it (Note [Gradient ownership] in `autograd.rs`), else into a new
/// tensor. GELU values and derivatives are computed exactly as [`Tensor::gelu`] computes them; only
/// the weight gradient's sum over rows is split by blocks.
pub fn gelu_linear(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    gelu_linear_computed(x, weight, bias, true)
}

/// [`gelu_linear`]'s node and output without the product: the same checks, allocations and saved
/// tensors, so the same graph and the same bytes, but the output's values are left as they are. Its
/// backward needs only `x` and the weight, never the output; for a checkpointed segment's re-run
/// ([`crate::autograd::Pass::Rerun`]) ending in this op, whose output values nobody reads (a
/// transformer block's MLP: its second product is a third of the block's forward).
pub fn gelu_linear_graph(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    gelu_linear_computed(x, weight, bias, false)
}

/// The row stride of GELU-linear's scratch: padded for the cpu's GEMM (`gelu_scratch_stride`), dense
/// on a GPU (cuBLAS reads it in place; the cuda backend counts a block's rows from its size).
fn scratch_stride(like: &Tensor, in_f: usize, block: usize) -> usize {
    match like.device().target() {
        crate::Target::Cpu => gelu_scratch_stride(in_f, block),
        crate::Target::Cuda => in_f,
    }
}

fn gelu_linear_computed(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>, compute: bool) -> Result<Tensor> {
    let _op = x.device().op_scope("gelu_linear");
    let (out_f, in_f) = check_linear("gelu_linear", x, weight, bias)?;
    let x = x.contiguous()?;
    let rows = x.numel() / in_f.max(1);
    let mut shape = x.shape().to_vec();
    *shape.last_mut().expect("rank >= 1") = out_f;
    let out = output(&x, &shape, x.dtype(), "gelu_linear")?;
    let block = rows.min(super::fused_block_rows(&x, GELU_ROWS));
    let scratch = output(&x, &[block, scratch_stride(&x, in_f, block)], x.dtype(), "gelu_linear")?;
    let b = contiguous_bias(bias)?;
    if compute {
        x.device().backend().gelu_linear(&x, weight, b.as_ref(), &scratch, &out, super::products_of(&x))?;
    }
    drop(b);
    drop(scratch);
    let mut inputs = vec![&x, weight];
    inputs.extend(bias);
    if !needs_grad(&inputs) {
        return Ok(out);
    }
    let back = GeluLinearBack { x: save_compact(&x)?, weight: save(weight), has_bias: bias.is_some() };
    Ok(record(out, "gelu_linear", &inputs, back))
}

struct GeluLinearBack {
    /// GELU's input; overwritten with its gradient in backward when exclusively owned.
    x: Compact,
    weight: Tensor,
    has_bias: bool,
}

impl Backward for GeluLinearBack {
    fn backward(self: Box<Self>, grad: Tensor, needs: &[bool]) -> Result<Vec<Option<Tensor>>> {
        const NAME: &str = "gelu_linear_backward";
        let GeluLinearBack { x, weight, has_bias } = *self;
        // On a GPU, x saved in its products' own 16 bits is read as saved (the kernels widen each
        // element as restoring it would: the same bits, without the restored copy or its cast),
        // its gradient then a new tensor.
        let read_saved = super::saved_in_operand_format(&x, &grad);
        let x = if read_saved { x.stored().clone() } else { x.into_tensor()? };
        let (out_f, in_f) = (weight.shape()[0], weight.shape()[1]);
        let g2 = grad.contiguous()?.reshape(&[-1, out_f as isize])?;
        let rows = g2.shape()[0];
        // Decided from who holds what, never from data, so meta allocates as cpu does.
        let in_place = needs[0] && !read_saved && x.owns_storage();
        let gx = if needs[0] && !in_place { Some(output(&grad, x.shape(), grad.dtype(), NAME)?) } else { None };
        let gw = if needs[1] { Some(output(&grad, &[out_f, in_f], grad.dtype(), NAME)?) } else { None };
        let gb = bias_grad(&g2, has_bias && needs[2], gw.is_some(), NAME)?;
        // Everything is allocated before x may be overwritten. With both gradients wanted, a block's
        // GELU output and derivative come from one erf per element (as in an unfused backward): the
        // derivative goes over x's block when in place, else into a second half of the scratch.
        let both = needs[0] && needs[1];
        let block = rows.min(super::fused_block_rows(&grad, GELU_ROWS));
        // (Read as saved, x's blocks are never overwritten: the derivative needs no second half.)
        let scratch_rows = if both && !in_place && !read_saved { 2 * block } else { block };
        let scratch = output(&grad, &[scratch_rows, scratch_stride(&grad, in_f, block)], grad.dtype(), NAME)?;
        // In place, the input gradient is x itself.
        let gx_target = if in_place { Some(&x) } else { gx.as_ref() };
        let gb_target = gb.as_ref().filter(|_| gw.is_some());
        grad.device().backend().gelu_linear_backward(
            &x,
            &weight,
            &g2,
            gx_target,
            gw.as_ref(),
            gb_target,
            &scratch,
            super::products_of(&x),
        )?;
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

    /// The graph-only variant allocates what gelu_linear allocates and gives the same gradients, but
    /// leaves its output's bytes as the allocator handed them over.
    #[test]
    fn gelu_linear_graph_allocates_and_differentiates_as_gelu_linear_without_computing() {
        let dev = Device::cpu();
        let (rows, i, o) = (GELU_ROWS + 9, 16, 12);
        let leaf = |n, salt, shape: &[usize]| t64(&dev, &values(n, salt), shape).set_requires_grad(true);
        let x = leaf(rows * i, 1, &[rows, i]);
        let (w, b) = (leaf(o * i, 2, &[o, i]), leaf(o, 3, &[o]));
        let g = t64(&dev, &values(rows * o, 4), &[rows, o]);
        let mut runs = Vec::new();
        for graph_only in [false, true] {
            // A freed block of the output's size holding 7s: the output is handed the same block.
            drop(t64(&dev, &vec![7.0; rows * o], &[rows, o]));
            let before = dev.allocator().timeline().events().count();
            let y = if graph_only { gelu_linear_graph(&x, &w, Some(&b)) } else { gelu_linear(&x, &w, Some(&b)) };
            let y = y.unwrap();
            let allocs = allocations_since(&dev, before);
            let values = y.to_f64_vec().unwrap();
            backward_with(&y, g.clone()).unwrap();
            let grads: Vec<Vec<f64>> =
                [&x, &w, &b].iter().map(|t| t.take_grad().unwrap().to_f64_vec().unwrap()).collect();
            runs.push((allocs, values, grads));
        }
        let ((allocs, computed, grads), (graph_allocs, untouched, graph_grads)) = (&runs[0], &runs[1]);
        assert_eq!(allocs, graph_allocs, "the same allocations");
        assert_eq!(grads, graph_grads, "the same gradients, bit for bit");
        assert!(computed.iter().all(|&v| v != 7.0), "the fused op computes its output");
        assert!(untouched.iter().all(|&v| v == 7.0), "the graph-only op leaves it as it was");
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
        let allocs = allocations_since(&dev, before);
        // The weight gradient and a scratch of one block of rows (GELU's output, then the gradient
        // before GELU; its derivative goes over the saved input, which becomes dx); then the affine's
        // backward (its own output).
        let block = (300.min(GELU_ROWS) * 64 * 8) as u64;
        assert_eq!(allocs[..2], [(4096, "gelu_linear_backward"), (block, "gelu_linear_backward")]);
        assert_eq!(allocs.len(), 3, "{allocs:?}");
        assert_eq!(dev.stats().category(Category::Activation).current, 0);
    }

    /// A whole block of rows 4 KiB apart gets a padded scratch (read in place by the GEMM), and the
    /// result is the unfused one's; a smaller block keeps exactly rows x in (its size class).
    #[test]
    fn gelu_scratch_is_padded_for_whole_blocks_of_4_kib_rows_only() {
        assert_eq!(gelu_scratch_stride(1024, GELU_ROWS), 1040);
        assert_eq!(gelu_scratch_stride(512, GELU_ROWS + 7), 528);
        assert_eq!(gelu_scratch_stride(1024, GELU_ROWS - 1), 1024);
        assert_eq!(gelu_scratch_stride(1000, GELU_ROWS), 1000);
        assert_eq!(gelu_scratch_stride(0, GELU_ROWS), 0);
        let dev = Device::cpu();
        for rows in [GELU_ROWS + 3, 40] {
            let x = t64(&dev, &values(rows * 512, 7), &[rows, 512]).set_requires_grad(true);
            let w = t64(&dev, &values(3 * 512, 8), &[3, 512]).set_requires_grad(true);
            let before = dev.allocator().timeline().events().count();
            let fused = gelu_linear(&x, &w, None).unwrap();
            let sizes: Vec<u64> = dev
                .allocator()
                .timeline()
                .events()
                .skip(before)
                .filter(|e| e.kind == memfit_memory::EventKind::Alloc && e.op == "gelu_linear")
                .map(|e| e.bytes)
                .collect();
            // The output (rows x 3) and the scratch (one block of rows).
            let stride = if rows > GELU_ROWS { 528 } else { 512 };
            assert!(sizes.contains(&((rows.min(GELU_ROWS) * stride * 8) as u64)), "rows {rows}: {sizes:?}");
            assert_eq!(sizes.len(), 2, "rows {rows}: {sizes:?}");
            let g = t64(&dev, &values(rows * 3, 9), &[rows, 3]);
            backward_with(&fused, g.clone()).unwrap();
            let got: Vec<Vec<f64>> = [&x, &w].iter().map(|t| t.take_grad().unwrap().to_f64_vec().unwrap()).collect();
            let plain = linear(&x.gelu().unwrap(), &w, None).unwrap();
            assert_close(&fused.to_f64_vec().unwrap(), &plain.to_f64_vec().unwrap(), 1e-12, "output");
            backward_with(&plain, g).unwrap();
            for (k, t) in [&x, &w].iter().enumerate() {
                assert_close(&got[k], &t.take_grad().unwrap().to_f64_vec().unwrap(), 1e-12, "gradient");
            }
        }
    }

    /// A strided bias is copied contiguous by the op (not the kernel), so meta allocates the copy too.
    #[test]
    fn strided_bias_meta_allocates_like_cpu() {
        assert_meta_matches_cpu(|dev| {
            let t = |shape: &[usize]| Tensor::full(dev, shape, 0.1, DType::F32, Category::Input);
            let (x, w) = (t(&[3, 8])?, t(&[5, 8])?);
            // One value broadcast to [5]: a bias with stride 0.
            let b = t(&[1])?.expand(&[5])?;
            assert!(!b.is_contiguous());
            linear(&x, &w, Some(&b))?;
            gelu_linear(&x, &w, Some(&b))?;
            let (lw, lb) = (t(&[8])?, t(&[8])?);
            crate::ops::layer_norm_linear(&x, &lw, &lb, 1e-5, &w, Some(&b))?;
            Ok(())
        });
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
