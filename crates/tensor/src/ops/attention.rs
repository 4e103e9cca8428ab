//! Scaled dot-product attention over [B, H, T, D] tensors, optional causal or boolean mask.
//!
//! One fused op: per (batch, head) matrix, `P = softmax(q k^T * scale + mask)` is computed with a GEMM
//! straight into the probability tensor, then `out = P v` with a second GEMM. Backward saves q, k, v
//! and P (nothing else) and overwrites P in place with dS (it owns P exclusively), so it needs no
//! [Tq, Tk] workspace: only a scratch of a few rows of dP per task.
//!
//! Fully masked rows (every key masked) give output 0 and gradient 0, like PyTorch's
//! `F.scaled_dot_product_attention` since 2.5 (its math backend applies `_safe_softmax`; the fused
//! CPU kernels agree). A plain `softmax` of such a row would be NaN.

use super::matmul::{gemm_into, Mat, SendPtr};
use super::{check_same, output};
use crate::autograd::{needs_grad, record, save, Backward};
use crate::dtype::{DType, Float};
use crate::error::{Error, Result};
use crate::layout::broadcast_layout;
use crate::tensor::{Element, Tensor};
use crate::with_float;
use rayon::prelude::*;

/// Rows of dP computed per GEMM in backward (the per-task scratch is DP_ROWS x Tk).
const DP_ROWS: usize = 32;

/// Sizes of one attention problem.
#[derive(Clone, Copy)]
struct Dims {
    /// Number of (batch, head) matrices.
    bh: usize,
    tq: usize,
    tk: usize,
    d: usize,
    dv: usize,
}

/// Runs `f(i, gemm_threads)` for every batch matrix: in parallel over matrices when there are
/// several, else one matrix with multi-threaded GEMMs.
fn for_each_matrix(bh: usize, f: impl Fn(usize, usize) + Sync + Send) {
    if bh > 1 {
        (0..bh).into_par_iter().for_each(|i| f(i, 1));
    } else {
        (0..bh).for_each(|i| f(i, rayon::current_num_threads()));
    }
}

/// The bool mask, broadcast to [batch..., Tq, Tk], read through its strides.
struct MaskView<'a> {
    bytes: &'a [u8],
    /// Shape and strides of the batch dims (broadcast; stride 0 where the mask has size 1).
    batch_shape: Vec<usize>,
    batch_strides: Vec<usize>,
    offset: usize,
    row_stride: usize,
    col_stride: usize,
}

impl MaskView<'_> {
    /// Element offset of (batch matrix i, row 0, col 0).
    fn base(&self, mut i: usize) -> usize {
        let mut o = self.offset;
        for (&n, &s) in self.batch_shape.iter().zip(&self.batch_strides).rev() {
            o += (i % n) * s;
            i /= n;
        }
        o
    }

    fn masked(&self, base: usize, r: usize, c: usize) -> bool {
        self.bytes[base + r * self.row_stride + c * self.col_stride] != 0
    }
}

/// Scales, masks and softmaxes one score row in place. Fully masked rows become 0.
fn softmax_row<T: Float>(row: &mut [T], scale: T, masked: impl Fn(usize) -> bool) {
    let mut m = T::neg_infinity();
    for (j, v) in row.iter_mut().enumerate() {
        *v = if masked(j) { T::neg_infinity() } else { *v * scale };
        // NaN wins, so a NaN score is never mistaken for a fully masked row.
        if *v > m || v.is_nan() {
            m = *v;
        }
    }
    if m == T::neg_infinity() {
        row.iter_mut().for_each(|v| *v = T::of(0.0));
        return;
    }
    let mut sum = T::of(0.0);
    for v in row.iter_mut() {
        *v = (*v - m).exp();
        sum += *v;
    }
    row.iter_mut().for_each(|v| *v = *v / sum);
}

#[allow(clippy::too_many_arguments)]
fn forward_kernel<T: Float + Element>(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    p: &Tensor,
    out: &Tensor,
    dims: Dims,
    scale: f64,
    causal: bool,
    mask: Option<&MaskView<'_>>,
) -> Result<()> {
    let Dims { bh, tq, tk, d, dv } = dims;
    let (qs, ks, vs) = (q.slice::<T>()?.as_ptr(), k.slice::<T>()?.as_ptr(), v.slice::<T>()?.as_ptr());
    let (qs, ks, vs) = (SendPtr(qs as *mut T), SendPtr(ks as *mut T), SendPtr(vs as *mut T));
    let pp = SendPtr(p.slice_mut::<T>()?.as_mut_ptr());
    let op = SendPtr(out.slice_mut::<T>()?.as_mut_ptr());
    let scale = T::of(scale);
    for_each_matrix(bh, |i, threads| {
        let (qs, ks, vs, pp, op) = (qs, ks, vs, pp, op);
        // SAFETY: matrix i's regions of q, k, v are in bounds; P_i and out_i are written only by this
        // task (disjoint regions of fresh tensors).
        unsafe {
            let pi = pp.0.add(i * tq * tk);
            let qi = Mat { ptr: qs.0.add(i * tq * d) as *const T, rs: d as isize, cs: 1 };
            let kt = Mat { ptr: ks.0.add(i * tk * d) as *const T, rs: 1, cs: d as isize };
            gemm_into::<T>(tq, tk, d, pi, tk as isize, false, qi, kt, threads);
            let base = mask.map(|m| m.base(i));
            for r in 0..tq {
                let row = std::slice::from_raw_parts_mut(pi.add(r * tk), tk);
                softmax_row(row, scale, |j| {
                    (causal && j > r) || matches!((mask, base), (Some(m), Some(b)) if m.masked(b, r, j))
                });
            }
            let pm = Mat { ptr: pi as *const T, rs: tk as isize, cs: 1 };
            let vi = Mat { ptr: vs.0.add(i * tk * dv) as *const T, rs: dv as isize, cs: 1 };
            gemm_into::<T>(tq, dv, tk, op.0.add(i * tq * dv), dv as isize, false, pm, vi, threads);
        }
    });
    Ok(())
}

/// `F.scaled_dot_product_attention(q [B,H,Tq,D], k [B,H,Tk,D], v [B,H,Tk,Dv], is_causal)` with scale
/// 1/sqrt(D). `mask` (bool, broadcastable to [B,H,Tq,Tk]) is True where attention is NOT allowed (the
/// convention of nn.MultiheadAttention's bool attn_mask). Causal: query i sees keys j <= i.
///
/// Any number of leading batch dims works (q, k and v must agree on them). `causal` and `mask` may be
/// combined (a key is then hidden when either hides it). A query row with every key hidden yields 0
/// (and gradient 0), as PyTorch's sdpa does.
pub fn scaled_dot_product_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    causal: bool,
    mask: Option<&Tensor>,
) -> Result<Tensor> {
    check_same("scaled_dot_product_attention", &[q, k, v])?;
    let r = q.rank();
    let bad = || {
        Error::shape(format!(
            "scaled_dot_product_attention: expected q [..., Tq, D], k [..., Tk, D], v [..., Tk, Dv] with the \
             same leading dims, got {:?}, {:?}, {:?}",
            q.shape(),
            k.shape(),
            v.shape()
        ))
    };
    if r < 2
        || k.rank() != r
        || v.rank() != r
        || q.shape()[..r - 2] != k.shape()[..r - 2]
        || q.shape()[..r - 2] != v.shape()[..r - 2]
    {
        return Err(bad());
    }
    let (tq, d, tk, dv) = (q.shape()[r - 2], q.shape()[r - 1], k.shape()[r - 2], v.shape()[r - 1]);
    if k.shape()[r - 1] != d || v.shape()[r - 2] != tk {
        return Err(bad());
    }
    if d == 0 {
        return Err(Error::shape("scaled_dot_product_attention: head dim D must be > 0"));
    }
    let batch = &q.shape()[..r - 2];
    let mut p_shape = batch.to_vec();
    p_shape.extend([tq, tk]);
    if let Some(m) = mask {
        if !m.device().same(q.device()) {
            return Err(Error::device("scaled_dot_product_attention: mask is on another device"));
        }
        if m.dtype() != DType::Bool {
            return Err(Error::dtype(format!("scaled_dot_product_attention: mask must be bool, got {}", m.dtype())));
        }
        let fits = m.rank() <= r && m.shape().iter().rev().zip(p_shape.iter().rev()).all(|(&a, &b)| a == b || a == 1);
        if !fits {
            return Err(Error::shape(format!(
                "scaled_dot_product_attention: mask {:?} does not broadcast to {p_shape:?}",
                m.shape()
            )));
        }
    }
    let dims = Dims { bh: batch.iter().product(), tq, tk, d, dv };
    let scale = 1.0 / (d as f64).sqrt();
    let (q, k, v) = (q.contiguous()?, k.contiguous()?, v.contiguous()?);
    let mut out_shape = batch.to_vec();
    out_shape.extend([tq, dv]);
    let out = output(&q, &out_shape, q.dtype(), "scaled_dot_product_attention")?;
    let p = output(&q, &p_shape, q.dtype(), "scaled_dot_product_attention")?;
    if q.device().computes() && out.numel() > 0 && p.numel() == 0 {
        // No keys (Tk = 0): every row is fully masked, so the output is 0.
        out.bytes_mut()?.fill(0);
    } else if q.device().computes() && out.numel() > 0 {
        let view = match mask {
            Some(m) => {
                let l = broadcast_layout(m.layout(), &p_shape);
                Some(MaskView {
                    bytes: m.storage_bytes()?,
                    batch_shape: l.shape()[..r - 2].to_vec(),
                    batch_strides: l.strides()[..r - 2].to_vec(),
                    offset: l.offset(),
                    row_stride: l.strides()[r - 2],
                    col_stride: l.strides()[r - 1],
                })
            }
            None => None,
        };
        with_float!(q.dtype(), "scaled_dot_product_attention", T =>
            forward_kernel::<T>(&q, &k, &v, &p, &out, dims, scale, causal, view.as_ref())?);
    }
    if !needs_grad(&[&q, &k, &v]) {
        return Ok(out);
    }
    let back = AttentionBack { q: save(&q), k: save(&k), v: save(&v), p: save(&p), dims, scale };
    drop(p);
    Ok(record(out, "scaled_dot_product_attention", &[&q, &k, &v], back))
}

struct AttentionBack {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    /// The attention probabilities; overwritten in place with dS during backward.
    p: Tensor,
    dims: Dims,
    scale: f64,
}

#[allow(clippy::too_many_arguments)]
fn backward_kernel<T: Float + Element>(
    b: &AttentionBack,
    p: &Tensor,
    go: &Tensor,
    gq: Option<&Tensor>,
    gk: Option<&Tensor>,
    gv: Option<&Tensor>,
) -> Result<()> {
    let Dims { bh, tq, tk, d, dv } = b.dims;
    let ptr = |t: &Tensor| -> Result<SendPtr<T>> { Ok(SendPtr(t.slice::<T>()?.as_ptr() as *mut T)) };
    let optr = |t: Option<&Tensor>| -> Result<Option<SendPtr<T>>> {
        t.map(|t| Ok(SendPtr(t.slice_mut::<T>()?.as_mut_ptr()))).transpose()
    };
    let (qs, ks, vs, gos) = (ptr(&b.q)?, ptr(&b.k)?, ptr(&b.v)?, ptr(go)?);
    // P is written in place (dS): it is exclusively owned by this backward (see the caller).
    let ps = SendPtr(p.slice_mut::<T>()?.as_mut_ptr());
    let (gqs, gks, gvs) = (optr(gq)?, optr(gk)?, optr(gv)?);
    let scale = T::of(b.scale);
    let need_ds = gq.is_some() || gk.is_some();
    for_each_matrix(bh, |i, threads| {
        let (qs, ks, vs, gos, ps, gqs, gks, gvs) = (qs, ks, vs, gos, ps, gqs, gks, gvs);
        // SAFETY: matrix i's regions of the inputs are in bounds; P_i and the gradients' matrix-i
        // regions are touched only by this task.
        unsafe {
            let pi = ps.0.add(i * tq * tk);
            let goi = gos.0.add(i * tq * dv) as *const T;
            let vi = vs.0.add(i * tk * dv) as *const T;
            if let Some(gvs) = gvs {
                // dV = P^T dO
                let pt = Mat { ptr: pi as *const T, rs: 1, cs: tk as isize };
                let g = Mat { ptr: goi, rs: dv as isize, cs: 1 };
                gemm_into::<T>(tk, dv, tq, gvs.0.add(i * tk * dv), dv as isize, false, pt, g, threads);
            }
            if !need_ds {
                return;
            }
            // dS = P * (dP - rowsum(dP * P)) * scale, with dP = dO V^T, a few rows at a time.
            let mut dp = vec![T::of(0.0); DP_ROWS.min(tq) * tk];
            for r0 in (0..tq).step_by(DP_ROWS) {
                let rows = DP_ROWS.min(tq - r0);
                let g = Mat { ptr: goi.add(r0 * dv), rs: dv as isize, cs: 1 };
                let vt = Mat { ptr: vi, rs: 1, cs: dv as isize };
                gemm_into::<T>(rows, tk, dv, dp.as_mut_ptr(), tk as isize, false, g, vt, threads);
                for r in 0..rows {
                    let prow = std::slice::from_raw_parts_mut(pi.add((r0 + r) * tk), tk);
                    let dprow = &dp[r * tk..(r + 1) * tk];
                    let dot = prow.iter().zip(dprow).fold(T::of(0.0), |a, (&p, &g)| a + p * g);
                    prow.iter_mut().zip(dprow).for_each(|(p, &g)| *p = *p * (g - dot) * scale);
                }
            }
            let qi = qs.0.add(i * tq * d) as *const T;
            let ki = ks.0.add(i * tk * d) as *const T;
            if let Some(gqs) = gqs {
                // dQ = dS K
                let ds = Mat { ptr: pi as *const T, rs: tk as isize, cs: 1 };
                let km = Mat { ptr: ki, rs: d as isize, cs: 1 };
                gemm_into::<T>(tq, d, tk, gqs.0.add(i * tq * d), d as isize, false, ds, km, threads);
            }
            if let Some(gks) = gks {
                // dK = dS^T Q
                let dst = Mat { ptr: pi as *const T, rs: 1, cs: tk as isize };
                let qm = Mat { ptr: qi, rs: d as isize, cs: 1 };
                gemm_into::<T>(tk, d, tq, gks.0.add(i * tk * d), d as isize, false, dst, qm, threads);
            }
        }
    });
    Ok(())
}

impl Backward for AttentionBack {
    fn backward(self: Box<Self>, grad: Tensor, needs: &[bool]) -> Result<Vec<Option<Tensor>>> {
        let go = grad.contiguous()?;
        let name = "scaled_dot_product_attention_backward";
        let gq = if needs[0] { Some(output(&go, self.q.shape(), go.dtype(), name)?) } else { None };
        let gk = if needs[1] { Some(output(&go, self.k.shape(), go.dtype(), name)?) } else { None };
        let gv = if needs[2] { Some(output(&go, self.v.shape(), go.dtype(), name)?) } else { None };
        // dS overwrites P. The saved P is normally the only handle on its storage; if not (never in
        // this crate), work on a copy instead of clobbering somebody else's data.
        let degenerate = go.numel() == 0 || self.p.numel() == 0;
        let p = if !degenerate && (needs[0] || needs[1]) && !self.p.owns_storage() {
            self.p.contiguous_copy()?
        } else {
            self.p.clone()
        };
        if go.device().computes() && degenerate {
            // Degenerate sizes (no keys, or Dv = 0): nothing flows back.
            for g in [&gq, &gk, &gv].into_iter().flatten() {
                if g.numel() > 0 {
                    g.bytes_mut()?.fill(0);
                }
            }
        } else if go.device().computes() {
            with_float!(go.dtype(), name, T =>
                backward_kernel::<T>(&self, &p, &go, gq.as_ref(), gk.as_ref(), gv.as_ref())?);
        }
        Ok(vec![gq, gk, gv])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::autograd::{backward, backward_with};
    use crate::ops::softmax::test_support::*;
    use crate::ops::{softmax, sum_to_shape};
    use crate::{Category, Device};

    fn bools(dev: &Device, v: &[bool], shape: &[usize]) -> Tensor {
        Tensor::from_slice(dev, v, shape, Category::Input).unwrap()
    }

    /// sdpa composed of public ops (matmul, softmax), with mask as a large negative bias.
    fn reference(q: &Tensor, k: &Tensor, v: &Tensor, causal: bool) -> Tensor {
        let d = q.shape()[q.rank() - 1] as f64;
        let s = q.matmul(&k.transpose(-2, -1).unwrap()).unwrap().mul_scalar(1.0 / d.sqrt()).unwrap();
        let s = if causal {
            let (tq, tk) = (s.shape()[s.rank() - 2], s.shape()[s.rank() - 1]);
            let bias: Vec<f64> = (0..tq * tk).map(|x| if x % tk > x / tk { -1e300 } else { 0.0 }).collect();
            let b = Tensor::from_slice(q.device(), &bias, &[tq, tk], Category::Input).unwrap();
            s.add(&b.to_dtype(q.dtype()).unwrap()).unwrap()
        } else {
            s
        };
        softmax(&s, -1).unwrap().matmul(v).unwrap()
    }

    #[test]
    fn hand_checked_uniform_attention() {
        let dev = Device::cpu();
        // q = k = 0: every allowed key gets the same weight.
        let q = t64(&dev, &[0.0; 6], &[1, 1, 3, 2]);
        let v = t64(&dev, &[1.0, 10.0, 2.0, 20.0, 6.0, 60.0], &[1, 1, 3, 2]);
        let y = scaled_dot_product_attention(&q, &q, &v, false, None).unwrap();
        assert_close(&y.to_f64_vec().unwrap(), &[3.0, 30.0, 3.0, 30.0, 3.0, 30.0], 1e-15, "plain");
        let y = scaled_dot_product_attention(&q, &q, &v, true, None).unwrap();
        assert_close(&y.to_f64_vec().unwrap(), &[1.0, 10.0, 1.5, 15.0, 3.0, 30.0], 1e-15, "causal");
        // A [Tq, Tk] mask broadcast over batch and heads; True hides the key.
        let m = bools(&dev, &[false, true, true, true, false, false, false, true, false], &[3, 3]);
        let y = scaled_dot_product_attention(&q, &q, &v, false, Some(&m)).unwrap();
        assert_close(&y.to_f64_vec().unwrap(), &[1.0, 10.0, 4.0, 40.0, 3.5, 35.0], 1e-15, "mask");
        // The scale is 1/sqrt(D): one key with score 2*sqrt(2)*... check against the formula.
        let q1 = t64(&dev, &[1.0, 1.0], &[1, 1, 1, 2]);
        let k1 = t64(&dev, &[1.0, 1.0, 0.0, 0.0], &[1, 1, 2, 2]);
        let v1 = t64(&dev, &[1.0, 0.0], &[1, 1, 2, 1]);
        let y = scaled_dot_product_attention(&q1, &k1, &v1, false, None).unwrap().item().unwrap();
        let e = (2.0 / 2f64.sqrt()).exp();
        assert_close(&[y], &[e / (e + 1.0)], 1e-15, "scale");
    }

    #[test]
    fn fully_masked_rows_give_zero_not_nan() {
        let dev = Device::cpu();
        let q = t64(&dev, &values(8, 1), &[1, 2, 2, 2]).set_requires_grad(true);
        let k = t64(&dev, &values(8, 2), &[1, 2, 2, 2]).set_requires_grad(true);
        let v = t64(&dev, &values(8, 3), &[1, 2, 2, 2]).set_requires_grad(true);
        // Head 0 row 1 sees nothing; everything else sees key 0 only.
        let m = bools(&dev, &[false, true, true, true, false, true, false, true], &[1, 2, 2, 2]);
        let y = scaled_dot_product_attention(&q, &k, &v, false, Some(&m)).unwrap();
        let yv = y.to_f64_vec().unwrap();
        assert_eq!(&yv[2..4], &[0.0, 0.0]);
        let vv = values(8, 3);
        assert_close(&[yv[0], yv[1], yv[4], yv[6]], &[vv[0], vv[1], vv[4], vv[4]], 1e-15, "single key");
        backward(&y.sum_all().unwrap()).unwrap();
        let gq = q.grad().unwrap().to_f64_vec().unwrap();
        assert!(gq.iter().all(|g| g.is_finite()));
        assert_eq!(&gq[2..4], &[0.0, 0.0]);
        // Key 1 of head 0 is never visible: no gradient reaches it.
        assert_eq!(&k.grad().unwrap().to_f64_vec().unwrap()[2..4], &[0.0, 0.0]);
        // Tk = 0: every row is empty, the output is zeros.
        let e = t64(&dev, &[], &[1, 1, 0, 2]);
        let q0 = q.narrow(1, 0, 1).unwrap();
        let y = scaled_dot_product_attention(&q0, &e, &e, false, None).unwrap();
        assert_eq!(y.to_f64_vec().unwrap(), vec![0.0; 4]);
        q.set_grad(None);
        backward(&y.sum_all().unwrap()).unwrap();
        assert_eq!(q.grad().unwrap().to_f64_vec().unwrap(), vec![0.0; 8]);
    }

    #[test]
    fn shape_errors() {
        let dev = Device::cpu();
        let q = t64(&dev, &[0.0; 24], &[1, 2, 3, 4]);
        let k5 = t64(&dev, &[0.0; 30], &[1, 2, 3, 5]);
        assert!(scaled_dot_product_attention(&q, &k5, &q, false, None).is_err());
        let q2 = t64(&dev, &[0.0; 24], &[2, 1, 3, 4]);
        assert!(scaled_dot_product_attention(&q, &q2, &q2, false, None).is_err());
        let bad_mask = bools(&dev, &[false; 4], &[2, 2]);
        assert!(scaled_dot_product_attention(&q, &q, &q, false, Some(&bad_mask)).is_err());
        let float_mask = t64(&dev, &[0.0; 9], &[3, 3]);
        assert!(scaled_dot_product_attention(&q, &q, &q, false, Some(&float_mask)).is_err());
    }

    #[test]
    fn gradients_match_finite_differences() {
        let (q, k, v) = (values(2 * 3 * 4, 1), values(2 * 5 * 4, 2), values(2 * 5 * 3, 3));
        let qs = (q.iter().map(|x| x * 2.0).collect::<Vec<_>>(), vec![1, 2, 3, 4]);
        let ks = (k.clone(), vec![1, 2, 5, 4]);
        let vs = (v.clone(), vec![1, 2, 5, 3]);
        let inputs = [qs, ks, vs];
        gradcheck(&inputs, |t| scaled_dot_product_attention(&t[0], &t[1], &t[2], false, None));
        gradcheck(&inputs, |t| scaled_dot_product_attention(&t[0], &t[1], &t[2], true, None));
        gradcheck(&inputs, |t| {
            let m: Vec<bool> = (0..15).map(|x| x % 4 == 1).collect();
            let m = bools(t[0].device(), &m, &[3, 5]);
            scaled_dot_product_attention(&t[0], &t[1], &t[2], false, Some(&m))
        });
    }

    #[test]
    fn matches_composed_ops_on_larger_inputs() {
        let dev = Device::cpu();
        // bh = 1 (threaded GEMMs) and bh = 6 (parallel over matrices); Tq != Tk, D != Dv.
        for (b, h) in [(1, 1), (2, 3)] {
            let (tq, tk, d, dv) = (70, 90, 16, 24);
            let q = t64(&dev, &values(b * h * tq * d, 4), &[b, h, tq, d]).set_requires_grad(true);
            let k = t64(&dev, &values(b * h * tk * d, 5), &[b, h, tk, d]).set_requires_grad(true);
            let v = t64(&dev, &values(b * h * tk * dv, 6), &[b, h, tk, dv]).set_requires_grad(true);
            for causal in [false, true] {
                let g = t64(&dev, &values(b * h * tq * dv, 7), &[b, h, tq, dv]);
                let y = scaled_dot_product_attention(&q, &k, &v, causal, None).unwrap();
                backward_with(&y, g.clone()).unwrap();
                let got: Vec<Vec<f64>> =
                    [&q, &k, &v].iter().map(|t| t.take_grad().unwrap().to_f64_vec().unwrap()).collect();
                let r = reference(&q, &k, &v, causal);
                assert_close(&y.to_f64_vec().unwrap(), &r.to_f64_vec().unwrap(), 1e-12, "output");
                backward_with(&r, g).unwrap();
                for (i, t) in [&q, &k, &v].iter().enumerate() {
                    let want = sum_to_shape(&t.take_grad().unwrap(), t.shape()).unwrap().to_f64_vec().unwrap();
                    assert_close(&got[i], &want, 1e-11, "gradient");
                }
            }
        }
    }

    #[test]
    fn golden_sdpa() {
        let g = Golden::open("attention.safetensors");
        let dev = Device::cpu();
        for dtype in [DType::F32, DType::F64] {
            for (case, causal) in [("sdpa", false), ("sdpa_causal", true), ("sdpa_cross", false)] {
                let name = format!("{case}_{}", suffix(dtype));
                let key = |s: &str| format!("{name}/{s}");
                let (q, k, v) = (g.leaf(&dev, &key("q")), g.leaf(&dev, &key("k")), g.leaf(&dev, &key("v")));
                let y = scaled_dot_product_attention(&q, &k, &v, causal, None).unwrap();
                assert_golden(&y, &g.f64s(&key("output")), dtype, &name);
                backward_with(&y, g.tensor(&dev, &key("grad_out"))).unwrap();
                assert_golden(&q.grad().unwrap(), &g.f64s(&key("grad_q")), dtype, &name);
                assert_golden(&k.grad().unwrap(), &g.f64s(&key("grad_k")), dtype, &name);
                assert_golden(&v.grad().unwrap(), &g.f64s(&key("grad_v")), dtype, &name);
            }
        }
    }

    #[test]
    fn backward_reuses_the_saved_probabilities() {
        // dS overwrites P in place: backward allocates only the three gradients.
        let dev = Device::cpu();
        let t = |n: usize, salt| t64(&dev, &values(n, salt), &[1, 2, 6, 4]).set_requires_grad(true);
        let (q, k, v) = (t(48, 1), t(48, 2), t(48, 3));
        let y = scaled_dot_product_attention(&q, &k, &v, true, None).unwrap();
        let g = t64(&dev, &values(48, 4), &[1, 2, 6, 4]);
        let before = dev.allocator().timeline().events().count();
        backward_with(&y, g).unwrap();
        let a = dev.allocator();
        let ops: Vec<&str> = a
            .timeline()
            .events()
            .skip(before)
            .filter(|e| e.kind == memfit_memory::EventKind::Alloc)
            .map(|e| e.op)
            .collect();
        assert_eq!(ops, vec!["scaled_dot_product_attention_backward"; 3]);
    }

    #[test]
    fn meta_allocates_like_cpu() {
        assert_meta_matches_cpu(|dev| {
            let t = |shape: &[usize]| -> Result<Tensor> {
                Ok(Tensor::full(dev, shape, 0.1, DType::F32, Category::Input)?.set_requires_grad(true))
            };
            let (q, k, v) = (t(&[2, 2, 4, 8])?, t(&[2, 2, 5, 8])?, t(&[2, 2, 5, 3])?);
            let m = Tensor::from_slice(dev, &[false, true, false, false, true], &[5], Category::Input)?;
            let y = scaled_dot_product_attention(&q, &k, &v, true, Some(&m))?;
            backward(&y.sum_all()?)
        });
    }
}
