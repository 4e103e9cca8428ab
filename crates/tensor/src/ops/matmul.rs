//! Matrix products: `matmul` (2-D, batched, broadcast batch dims) and `linear` (PyTorch's
//! `x W^T + b`). Products run on the `gemm` crate, which takes arbitrary strides, so transposed views
//! are multiplied without copies.

use super::{check_same, output, sum_to_shape};
use crate::autograd::{needs_grad, record, save, Backward};
use crate::dtype::Float;
use crate::error::{Error, Result};
use crate::layout::{broadcast_layout, broadcast_shapes, Layout};
use crate::tensor::Tensor;
use crate::with_float;
use rayon::prelude::*;

/// A strided matrix operand: base pointer, row stride, column stride (in elements).
#[derive(Clone, Copy)]
pub(crate) struct Mat<T> {
    pub ptr: *const T,
    pub rs: isize,
    pub cs: isize,
}

/// A raw pointer that may cross into rayon tasks; each task writes a disjoint region.
#[derive(Clone, Copy)]
pub(crate) struct SendPtr<T>(pub *mut T);
// SAFETY: used only to hand disjoint output regions to parallel tasks.
unsafe impl<T> Send for SendPtr<T> {}
// SAFETY: see above.
unsafe impl<T> Sync for SendPtr<T> {}
// SAFETY: read-only operand pointers shared by parallel tasks.
unsafe impl<T> Send for Mat<T> {}
// SAFETY: see above.
unsafe impl<T> Sync for Mat<T> {}

/// Work (m*n*k) above which a single product is split across threads by gemm itself.
const GEMM_PARALLEL_WORK: usize = 48 * 48 * 48;

/// `dst[m x n] (+)= a[m x k] @ b[k x n]`; `dst` row stride `dst_rs`, column stride 1.
/// `accumulate` adds to dst instead of overwriting it.
///
/// # Safety
/// All pointers must be valid for the given shapes and strides, and `dst` must not alias `a` or `b`.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn gemm_into<T: Float>(
    m: usize,
    n: usize,
    k: usize,
    dst: *mut T,
    dst_rs: isize,
    accumulate: bool,
    a: Mat<T>,
    b: Mat<T>,
    threads: usize,
) {
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            for i in 0..m {
                for j in 0..n {
                    *dst.offset(i as isize * dst_rs + j as isize) = T::zero();
                }
            }
        }
        return;
    }
    let parallelism = if threads > 1 && m * n * k >= GEMM_PARALLEL_WORK {
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    };
    // gemm computes dst = alpha * dst + beta * a @ b (alpha ignored when read_dst is false).
    gemm::gemm(
        m,
        n,
        k,
        dst,
        1,
        dst_rs,
        accumulate,
        a.ptr,
        a.cs,
        a.rs,
        b.ptr,
        b.cs,
        b.rs,
        T::one(),
        T::one(),
        false,
        false,
        false,
        parallelism,
    );
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

/// `x W^T + b` over the last dim of `x` (PyTorch's `F.linear`): x [..., in], weight [out, in], bias [out].
pub fn linear(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    let mut all = vec![x, weight];
    all.extend(bias);
    check_same("linear", &all)?;
    if x.rank() < 1 || weight.rank() != 2 {
        return Err(Error::shape(format!("linear: input {:?}, weight {:?}", x.shape(), weight.shape())));
    }
    let (out_f, in_f) = (weight.shape()[0], weight.shape()[1]);
    if x.shape()[x.rank() - 1] != in_f {
        return Err(Error::shape(format!(
            "linear: input has {} features but the weight {:?} expects {in_f}",
            x.shape()[x.rank() - 1],
            weight.shape()
        )));
    }
    if let Some(b) = bias {
        if b.shape() != [out_f] {
            return Err(Error::shape(format!("linear: bias {:?} should be [{out_f}]", b.shape())));
        }
    }
    let x = x.contiguous()?;
    let rows = x.numel() / in_f.max(1);
    let mut shape = x.shape().to_vec();
    *shape.last_mut().expect("rank >= 1") = out_f;
    let out = output(&x, &shape, x.dtype(), "linear")?;
    if x.device().computes() {
        with_float!(x.dtype(), "linear", T => {
            let dst = out.slice_mut::<T>()?;
            if let Some(b) = bias {
                let b = b.contiguous()?;
                let bv = b.slice::<T>()?;
                dst.chunks_mut(out_f).for_each(|r| r.copy_from_slice(bv));
            }
            let w = weight.layout();
            let wp = weight.storage_ptr()? as *const T;
            // W^T as a [in, out] operand: element (i, o) is W[o, i].
            // SAFETY: offsets come from the weight's layout.
            let wt = Mat { ptr: unsafe { wp.add(w.offset()) }, rs: w.strides()[1] as isize, cs: w.strides()[0] as isize };
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
