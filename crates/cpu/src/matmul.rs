//! CPU kernels of the matrix products (`ops/matmul.rs`): batched, broadcast `matmul`, `linear` and the
//! fused `gelu_linear` with its block-by-block backward, all on `memfit-kernels`' GEMM (strided
//! operands, so transposed views multiply without copies). Also the linear-layer glue the fused
//! normalization kernels share (`weight_mat`, `bias_row`).

use super::elementwise::{
    for_row_groups, gelu_backward_over_input, gelu_backward_slice, gelu_slice, gelu_with_derivative_slice,
};
use super::gemm::{
    gemm_bias_into, gemm_into, gemm_row_blocks_into, gemm_summing_into, prepared_gemm_into, with_prepared_b, Mat,
    Prepared, Products, SendPtr, GEMM_PARALLEL_WORK,
};
use crate::dtype::Float;
use crate::error::{check_len, Result};
use crate::layout::{broadcast_layout, Layout};
use crate::view::View;
use crate::with_float;
use rayon::prelude::*;

/// Rows [`gelu_linear`] runs per block (its scratch holds GELU_ROWS rows of the input).
pub const GELU_ROWS: usize = 1024;

/// The row stride, in elements, of the fused GELU-linear's scratch of `block_rows` rows of `in_f`
/// inputs: `in_f`, padded by 16 elements when rows of `in_f` f32 or f64 values would be a multiple
/// of 4 KiB apart, so that the GEMM reads the scratch in place instead of packing it
/// (`memfit_kernels::gemm` packs operands whose rows are 4 KiB apart). Only for whole blocks of
/// `GELU_ROWS` rows: a smaller scratch stays exactly rows x in_f, so a small micro-batch's scratch
/// does not grow past an allocator size class (1 MiB exactly would become a large-pool block). The
/// op sizes the scratch with it.
pub fn gelu_scratch_stride(in_f: usize, block_rows: usize) -> usize {
    if in_f > 0 && in_f.is_multiple_of(512) && block_rows >= GELU_ROWS {
        in_f + 16
    } else {
        in_f
    }
}

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

/// `out = a @ b` over the last two dims, the batch dims of `a` and `b` broadcast to `out`'s.
pub fn matmul(a: View<'_>, b: View<'_>, out: View<'_>, products: Products) -> Result<()> {
    let (ra, rb, ro) = (a.rank(), b.rank(), out.rank());
    let (m, k, n) = (a.shape()[ra - 2], a.shape()[ra - 1], b.shape()[rb - 1]);
    let batch = &out.shape()[..ro - 2];
    let mut sa = batch.to_vec();
    sa.extend([m, k]);
    let mut sb = batch.to_vec();
    sb.extend([k, n]);
    let (la, lb) = (broadcast_layout(a.layout(), &sa), broadcast_layout(b.layout(), &sb));
    let (oa, ob) = (batch_offsets(&la), batch_offsets(&lb));
    with_float!(a.dtype(), "matmul", T => {
        let pa = SendPtr(a.storage_ptr() as *mut T);
        let pb = SendPtr(b.storage_ptr() as *mut T);
        let dst = out.slice_mut::<T>()?;
        check_len("matmul output", dst.len(), oa.len() * m * n)?;
        let dst = SendPtr(dst.as_mut_ptr());
        let threads = rayon::current_num_threads();
        let run = |i: usize, threads: usize| {
            let (d, pa, pb) = (dst, pa, pb);
            // SAFETY: batch i writes its own m x n block of the fresh output; operands are in bounds.
            unsafe {
                gemm_into::<T>(m, n, k, d.0.add(i * m * n), n as isize, false,
                    mat_of(pa.0 as *const T, &la, oa[i]), mat_of(pb.0 as *const T, &lb, ob[i]), threads, products)
            }
        };
        if oa.len() > 1 && m * n * k < GEMM_PARALLEL_WORK {
            (0..oa.len()).into_par_iter().for_each(|i| run(i, 1));
        } else {
            (0..oa.len()).for_each(|i| run(i, threads));
        }
    });
    Ok(())
}

/// The weight [out, in] as a GEMM operand: transposed ([in, out], for `x W^T`) or as stored.
pub(crate) fn weight_mat<T>(weight: View<'_>, transposed: bool) -> Result<Mat<T>> {
    let w = weight.layout();
    // SAFETY: the offset comes from the weight's layout.
    let ptr = unsafe { (weight.storage_ptr() as *const T).add(w.offset()) };
    let (s0, s1) = (w.strides()[0] as isize, w.strides()[1] as isize);
    Ok(if transposed { Mat { ptr, rs: s1, cs: s0 } } else { Mat { ptr, rs: s0, cs: s1 } })
}

/// The bias row of a linear layer's output (`out_f` values, checked), for the GEMM to add as it
/// writes each tile of the output.
pub(crate) fn bias_row<T: Float + crate::dtype::Element>(
    bias: Option<View<'_>>,
    out_f: usize,
) -> Result<Option<*const T>> {
    let Some(b) = bias else { return Ok(None) };
    let bv = b.slice::<T>()?;
    check_len("linear bias", bv.len(), out_f)?;
    Ok(Some(bv.as_ptr()))
}

/// `out = x W^T + b` (x contiguous [rows, in], bias contiguous).
pub fn linear(x: View<'_>, weight: View<'_>, bias: Option<View<'_>>, out: View<'_>, products: Products) -> Result<()> {
    let (out_f, in_f) = (weight.shape()[0], weight.shape()[1]);
    let rows = x.numel() / in_f.max(1);
    with_float!(x.dtype(), "linear", T => {
        let dst = out.slice_mut::<T>()?;
        check_len("linear output", dst.len(), rows * out_f)?;
        let bias = bias_row::<T>(bias, out_f)?;
        // W^T as a [in, out] operand: element (i, o) is W[o, i].
        let wt = weight_mat::<T>(weight, true)?;
        let xs = Mat { ptr: x.slice::<T>()?.as_ptr(), rs: in_f as isize, cs: 1 };
        // SAFETY: fresh output of rows x out_f; operands valid for their layouts.
        unsafe { gemm_bias_into::<T>(rows, out_f, in_f, dst.as_mut_ptr(), out_f as isize, bias, xs, wt, rayon::current_num_threads(), products) };
    });
    Ok(())
}

/// A linear layer's weight gradient `gw = grad^T x` ([out, in], from `grad` [rows, out] and `x`
/// [rows, in]) and, when given, its bias gradient `gb` (the column sums of `grad`, added up as the
/// product reads `grad`: no pass of their own).
pub fn linear_weight_grad(
    grad: View<'_>,
    x: View<'_>,
    gw: View<'_>,
    gb: Option<View<'_>>,
    products: Products,
) -> Result<()> {
    const NAME: &str = "linear_weight_grad";
    let (out_f, in_f) = (gw.shape()[0], gw.shape()[1]);
    // The rows are x's; the output gradient must have as many.
    let rows = x.numel() / in_f.max(1);
    with_float!(grad.dtype(), NAME, T => {
        let (gs, xs, dst) = (grad.slice::<T>()?, x.slice::<T>()?, gw.slice_mut::<T>()?);
        check_len("linear_weight_grad output gradient", gs.len(), rows * out_f)?;
        check_len("linear_weight_grad weight gradient", dst.len(), out_f * in_f)?;
        let gbp = bias_grad_ptr::<T>(NAME, gb, out_f, true)?;
        let g_t = Mat { ptr: gs.as_ptr(), rs: 1, cs: out_f as isize };
        let xm = Mat { ptr: xs.as_ptr(), rs: in_f as isize, cs: 1 };
        // SAFETY: the gradients are fresh tensors of the checked lengths; the operands are in bounds.
        unsafe {
            gemm_summing_into::<T>(out_f, in_f, rows, dst.as_mut_ptr(), in_f as isize, false, g_t, xm, rayon::current_num_threads(), gbp, products)
        };
    });
    Ok(())
}

/// The bias gradient `gb` ([out]) of a linear backward, checked and zeroed for a weight-gradient
/// product to add its column sums of the output gradient into: only alongside the weight gradient
/// (`with_weight`), which is what reads the output gradient.
pub(crate) fn bias_grad_ptr<T: Float + crate::dtype::Element>(
    name: &str,
    gb: Option<View<'_>>,
    out_f: usize,
    with_weight: bool,
) -> Result<Option<*mut T>> {
    let Some(gb) = gb else { return Ok(None) };
    if !with_weight {
        return Err(crate::error::Error::invalid(format!(
            "{name}: a bias gradient is summed by the weight-gradient product, so it needs the weight gradient too"
        )));
    }
    let g = gb.slice_mut::<T>()?;
    check_len(&format!("{name} bias gradient"), g.len(), out_f)?;
    g[..out_f].fill(<T as Float>::of(0.0));
    Ok(Some(g.as_mut_ptr()))
}

/// `out = gelu(x) W^T + b`, `GELU_ROWS` rows at a time through `scratch` (at least
/// min(rows, GELU_ROWS) x in).
pub fn gelu_linear(
    x: View<'_>,
    weight: View<'_>,
    bias: Option<View<'_>>,
    scratch: View<'_>,
    out: View<'_>,
    products: Products,
) -> Result<()> {
    let (out_f, in_f) = (weight.shape()[0], weight.shape()[1]);
    let rows = x.numel() / in_f.max(1);
    with_float!(x.dtype(), "gelu_linear", T => {
        let dst = out.slice_mut::<T>()?;
        check_len("gelu_linear output", dst.len(), rows * out_f)?;
        let bias = bias_row::<T>(bias, out_f)?;
        let wt = weight_mat::<T>(weight, true)?;
        let block = rows.min(GELU_ROWS);
        let (xs, stride) = (x.slice::<T>()?, gelu_scratch_stride(in_f, block));
        let sc = scratch.slice_mut::<T>()?;
        check_len("gelu_linear scratch", sc.len(), block * stride)?;
        let sc = SendPtr(sc.as_mut_ptr());
        let gelu_rows = |r0: usize, n: usize| {
            for_row_groups(n, in_f, |g0, gn| {
                for r in g0..g0 + gn {
                    // SAFETY: scratch row r (of a block that fits the scratch) is this task's.
                    let yr = unsafe { sc.slice_mut(r * stride, in_f) };
                    gelu_slice(&xs[(r0 + r) * in_f..(r0 + r + 1) * in_f], yr);
                }
            });
            Mat { ptr: sc.0 as *const T, rs: stride as isize, cs: 1 }
        };
        // SAFETY: the fresh output holds rows x out; the scratch, a separate tensor, holds a block.
        unsafe {
            gemm_row_blocks_into::<T>(rows, out_f, in_f, dst.as_mut_ptr(), out_f as isize, bias,
                GELU_ROWS, gelu_rows, wt, products)
        };
    });
    Ok(())
}

/// Backward of [`gelu_linear`] from `grad` [rows, out]: the input gradient into `gx` (which is `x`
/// itself when the op decided to write it in place), the weight gradient into `gw` and, with it, the
/// bias gradient into `gb` (summed as the weight-gradient product reads `grad`), each when present. `scratch` holds min(rows, GELU_ROWS) rows of in, twice that when both gradients are
/// wanted and `gx` is not `x`.
#[allow(clippy::too_many_arguments)]
pub fn gelu_linear_backward(
    x: View<'_>,
    weight: View<'_>,
    grad: View<'_>,
    gx: Option<View<'_>>,
    gw: Option<View<'_>>,
    gb: Option<View<'_>>,
    scratch: View<'_>,
    products: Products,
) -> Result<()> {
    const NAME: &str = "gelu_linear_backward";
    let (out_f, in_f) = (weight.shape()[0], weight.shape()[1]);
    let rows = grad.shape()[0];
    let in_place = gx.is_some_and(|g| g.same(x));
    let block = rows.min(GELU_ROWS);
    with_float!(grad.dtype(), NAME, T => {
        let gs = grad.slice::<T>()?;
        check_len("gelu_linear_backward output gradient", gs.len(), rows * out_f)?;
        // In place, the input gradient is x itself: reads of a block of x finish before the
        // block is overwritten.
        let xs = x.slice_mut::<T>()?;
        check_len("gelu_linear_backward input", xs.len(), rows * in_f)?;
        let xp = xs.as_mut_ptr();
        let gxp = match gx {
            Some(_) if in_place => Some(xp),
            Some(t) => {
                let gxs = t.slice_mut::<T>()?;
                check_len("gelu_linear_backward input gradient", gxs.len(), rows * in_f)?;
                Some(gxs.as_mut_ptr())
            }
            None => None,
        };
        let gwp = gw.map(|t| t.slice_mut::<T>()).transpose()?;
        if let Some(g) = &gwp {
            check_len("gelu_linear_backward weight gradient", g.len(), out_f * in_f)?;
        }
        let gbp = bias_grad_ptr::<T>(NAME, gb, out_f, gwp.is_some())?;
        if rows == 0 {
            if let Some(gw) = gwp {
                gw.fill(<T as Float>::of(0.0));
            }
        } else {
            let gwp = gwp.map(|s| s.as_mut_ptr());
            let stride = gelu_scratch_stride(in_f, block);
            // The derivative's rows follow the scratch's when both gradients are wanted out of place.
            let deriv_rows = if gxp.is_some() && gwp.is_some() && !in_place { block } else { 0 };
            let scratch = scratch.slice_mut::<T>()?;
            check_len("gelu_linear_backward scratch", scratch.len(), block * stride + deriv_rows * in_f)?;
            let (sc, deriv) = scratch.split_at_mut(block * stride);
            let (scp, dp, xsp, gxs) = (SendPtr(sc.as_mut_ptr()), SendPtr(deriv.as_mut_ptr()), SendPtr(xp), gxp.map(SendPtr));
            let w = weight_mat::<T>(weight, false)?;
            let threads = rayon::current_num_threads();
            // The blocks, with W prepared once for all their dx products (given exactly when dx is
            // wanted).
            let blocks = |w_prep: Option<&Prepared<T>>| {
                for r0 in (0..rows).step_by(GELU_ROWS) {
                    let n = GELU_ROWS.min(rows - r0);
                    // Row r of the block: of the scratch (`stride` apart), of x, of the derivative
                    // (second half of the scratch) and of dx. The block's rows are inside their
                    // tensors, and each row is used by one task at a time: the element-wise passes below
                    // give each task its own rows, and the GEMMs run between them.
                    // SAFETY: as just said.
                    let sc_row = |r: usize| unsafe { scp.slice_mut(r * stride, in_f) };
                    // SAFETY: as just said.
                    let x_row = |r: usize| unsafe { xsp.slice_mut((r0 + r) * in_f, in_f) };
                    // SAFETY: as just said.
                    let d_row = |r: usize| unsafe { dp.slice_mut(r * in_f, in_f) };
                    // SAFETY: as just said.
                    let gx_row = |g: SendPtr<T>, r: usize| unsafe { g.slice_mut((r0 + r) * in_f, in_f) };
                    let each_row = |f: &(dyn Fn(usize) + Sync)| for_row_groups(n, in_f, |g0, gn| (g0..g0 + gn).for_each(f));
                    let g_t = Mat { ptr: gs[r0 * out_f..].as_ptr(), rs: 1, cs: out_f as isize };
                    let g_rows = Mat { ptr: gs[r0 * out_f..].as_ptr(), rs: out_f as isize, cs: 1 };
                    let y = Mat { ptr: scp.0 as *const T, rs: stride as isize, cs: 1 };
                    // SAFETY: the operands are in bounds; the scratch and gw are separate tensors.
                    unsafe {
                        if let (Some(gwp), Some(gxs), Some(w_prep)) = (gwp, gxs, w_prep) {
                            // gelu(x) and gelu'(x) in one pass; dW (+)= g_block^T gelu(x_block); then
                            // dx = (g_block W) * gelu'(x_block), over x's block when in place.
                            each_row(&|r| {
                                if in_place {
                                    // x row -> (y, gelu'(x)) with gelu'(x) over x's row.
                                    gelu_with_derivative_slice(sc_row(r), x_row(r));
                                } else {
                                    let d = d_row(r);
                                    d.copy_from_slice(x_row(r));
                                    gelu_with_derivative_slice(sc_row(r), d);
                                }
                            });
                            gemm_summing_into::<T>(out_f, in_f, n, gwp, in_f as isize, r0 > 0, g_t, y, threads, gbp, products);
                            prepared_gemm_into::<T>(w_prep, n, scp.0, stride as isize, false, g_rows, threads);
                            each_row(&|r| {
                                let g = sc_row(r);
                                if in_place {
                                    // dx over the derivative, both x's row: one reference to it.
                                    x_row(r).iter_mut().zip(g.iter()).for_each(|(d, &g)| *d *= g);
                                } else {
                                    let (d, dst) = (d_row(r), gx_row(gxs, r));
                                    dst.iter_mut().zip(g.iter().zip(d.iter())).for_each(|(o, (&g, &d))| *o = g * d);
                                }
                            });
                            continue;
                        }
                        if let Some(gwp) = gwp {
                            // dW (+)= g_block^T gelu(x_block)
                            each_row(&|r| gelu_slice(x_row(r), sc_row(r)));
                            gemm_summing_into::<T>(out_f, in_f, n, gwp, in_f as isize, r0 > 0, g_t, y, threads, gbp, products);
                        }
                        if let (Some(gxs), Some(w_prep)) = (gxs, w_prep) {
                            // dx = (g_block W) * gelu'(x_block)
                            prepared_gemm_into::<T>(w_prep, n, scp.0, stride as isize, false, g_rows, threads);
                            each_row(&|r| {
                                if in_place {
                                    gelu_backward_over_input(sc_row(r), x_row(r));
                                } else {
                                    gelu_backward_slice(x_row(r), sc_row(r), gx_row(gxs, r));
                                }
                            });
                        }
                    }
                }
            };
            if gxs.is_some() {
                // SAFETY: W is a parameter, unchanged during this call.
                unsafe { with_prepared_b(out_f, in_f, w, products, |w_prep| blocks(Some(w_prep))) };
            } else {
                blocks(None);
            }
        }
    });
    Ok(())
}
