//! 2-D convolution (cross-correlation, NCHW, weight [out, in/groups, kh, kw]) with stride, padding,
//! dilation and groups, by im2col + GEMM. The im2col workspace comes from the allocator as a temporary,
//! sized from the shapes, the element size and the device's products only (never from the thread
//! count), so meta and cpu allocate the same bytes.
//!
//! Note [conv2d work plan]: the batch is split into `lanes` contiguous runs of samples; each lane
//! owns one im2col tile of the workspace (`[C*kh*kw, rows*OW]`, `rows` output rows at a time, so
//! one huge image never needs a huge workspace; in backward also the output gradient's tile
//! transposed to `[rows*OW, O]`, which GEMM reads much faster than a strided view) and processes
//! its samples one after another with single-threaded GEMMs, while the lanes run in parallel. With
//! one lane, GEMM and im2col themselves use all threads. Lanes, rows per tile and therefore every
//! allocation follow from the shapes and the element size only (and, for a depthwise convolution,
//! the device's products: below). The weight gradient is a reduction
//! over samples: every lane accumulates its samples into its own partial (per group the transposed
//! `[C/groups*kh*kw, O/groups]`, which GEMM computes faster than the weight's own layout), and the
//! partials are added in lane order at the end, so the result does not depend on the thread count
//! either. 1x1 convolutions with stride 1 and no padding use the input itself as the im2col matrix.
//! Backward saves the input and the weight (not the im2col matrix) and recomputes im2col.
//!
//! On a GPU target (`cuda`, and `meta:cuda` predicting it) the plan is the GPU kernels': tiles of
//! im2col columns only and no weight partials (cuBLAS adds each tile's product into the weight
//! gradient itself, reading the output gradient transposed in place), and lanes that run together
//! rather than apart: step j takes sample j of every lane, so one im2col launch fills all the lanes'
//! tiles and one strided batched product serves them all (a launch per sample made the small
//! convolutions launch-bound): [`limits_for`].
//!
//! Note [Batched columns]: a sample's product `W [O, C*kh*kw] @ im2col [C*kh*kw, OH*OW]` is skinny
//! when the output has few positions (resnet18's last stages at 28 x 28: 4 and 1): each sample reads
//! the whole weight (9.4 MB for a 512-channel 3x3) for a handful of columns, and the step is bound by
//! memory. On the cpu, samples of fewer than `batch_columns` positions are then laid side by side in a
//! tile (`batch` whole samples, at least `batch_columns` columns, within the tile's bytes): one product
//! serves them all, through an output tile `[O, batch*OH*OW]` whose columns are scattered to the
//! samples (bias added there), and in backward the output gradient transposed to `[batch*OH*OW, O]`
//! serves both gradients' products. Such a convolution is never `direct` (the input is not its own
//! im2col matrix across samples). The plan depends on the shapes only, as every other choice here
//! but the depthwise one below.
//!
//! A depthwise convolution (each output channel reads one input channel: groups = C > 1) with f32
//! products takes none of this on the cpu: its kernels compute it tap by tap, with no workspace and
//! no weight partials (`depthwise` in the plan; Note [Depthwise convolution] in `memfit-cpu`'s
//! `conv/depthwise.rs`). Under bf16 or fp16 products, and on a GPU, it goes through im2col as any
//! grouped convolution.
//!
//! This file plans (shapes, work plan, workspaces) and records autograd; the kernels that follow the
//! plan are the backend's (`memfit-cpu`'s `conv.rs`).

use super::{check_same, output};
use crate::autograd::{needs_grad, record, save, save_compact, Backward, Compact};
use crate::error::{Error, Result};
use crate::tensor::Tensor;
pub(crate) use memfit_cpu::conv::ConvGeom;

/// Hyper-parameters of a 2-D convolution, `[h, w]` pairs as in PyTorch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Conv2dParams {
    pub stride: [usize; 2],
    pub padding: [usize; 2],
    pub dilation: [usize; 2],
    pub groups: usize,
}

impl Default for Conv2dParams {
    fn default() -> Self {
        Conv2dParams { stride: [1, 1], padding: [0, 0], dilation: [1, 1], groups: 1 }
    }
}

/// Byte budgets that size the workspaces (Note [conv2d work plan]).
#[derive(Clone, Copy, Debug)]
struct Limits {
    /// At most this many bytes per im2col tile (at least one output row).
    tile_bytes: usize,
    /// Lanes are added while all lanes' tiles and weight partials fit in this many bytes.
    workspace_bytes: usize,
    max_lanes: usize,
    /// The weight gradient goes through a transposed output-gradient tile per lane and per-lane
    /// partials (the cpu kernels); without, the product accumulates into it directly (cuBLAS).
    staged_weight_grad: bool,
    /// Samples of fewer output positions than this go side by side in a tile, this many columns
    /// at least (Note [Batched columns]); 0: never.
    batch_columns: usize,
    /// A depthwise convolution (groups = C > 1) with f32 products is computed tap by tap, with no
    /// workspace (the cpu's kernels: Note [Depthwise convolution] in `memfit-cpu`'s `conv/depthwise.rs`).
    depthwise_direct: bool,
}

const LIMITS: Limits = Limits {
    tile_bytes: 4 << 20,
    workspace_bytes: 8 << 20,
    max_lanes: 32,
    staged_weight_grad: true,
    batch_columns: 256,
    depthwise_direct: true,
};

/// The work plan's budgets on a GPU: lanes batched together within 1 MiB (so batching small samples
/// never asks for more than the small pool's blocks, or than one large sample's tile), nothing staged.
const CUDA_LIMITS: Limits = Limits {
    tile_bytes: 4 << 20,
    workspace_bytes: 1 << 20,
    max_lanes: 256,
    staged_weight_grad: false,
    batch_columns: 0,
    depthwise_direct: false,
};

/// The work plan of the machine a device's allocations follow.
fn limits_for(target: crate::Target) -> Limits {
    match target {
        crate::Target::Cpu => LIMITS,
        crate::Target::Cuda => CUDA_LIMITS,
    }
}

fn geometry(x: &[usize], wt: &[usize], params: &Conv2dParams, elem: usize, limits: Limits) -> Result<ConvGeom> {
    if x.len() != 4 {
        return Err(Error::shape(format!("conv2d: input must be [N, C, H, W] or [C, H, W], got {x:?}")));
    }
    if wt.len() != 4 {
        return Err(Error::shape(format!("conv2d: weight must be [out, in/groups, kh, kw], got {wt:?}")));
    }
    let (n, c, h, w) = (x[0], x[1], x[2], x[3]);
    let (o, cg, kh, kw) = (wt[0], wt[1], wt[2], wt[3]);
    let Conv2dParams { stride, padding, dilation, groups } = *params;
    if groups == 0 {
        return Err(Error::shape("conv2d: groups must be at least 1"));
    }
    if stride.contains(&0) {
        return Err(Error::shape(format!("conv2d: stride {stride:?} must be positive")));
    }
    if dilation.contains(&0) {
        return Err(Error::shape(format!("conv2d: dilation {dilation:?} must be positive")));
    }
    if kh == 0 || kw == 0 {
        return Err(Error::shape(format!("conv2d: weight {wt:?} has an empty kernel")));
    }
    if c % groups != 0 {
        return Err(Error::shape(format!(
            "conv2d: input {x:?} has {c} channels, which groups={groups} does not divide"
        )));
    }
    if o % groups != 0 {
        return Err(Error::shape(format!(
            "conv2d: weight {wt:?} has {o} output channels, which groups={groups} does not divide"
        )));
    }
    if cg != c / groups {
        return Err(Error::shape(format!(
            "conv2d: weight {wt:?} expects {cg} input channels per group, but input {x:?} with groups={groups} has {}",
            c / groups
        )));
    }
    let out_size = |size: usize, k: usize, s: usize, p: usize, d: usize| -> Option<usize> {
        let span = d.checked_mul(k - 1)?.checked_add(1)?;
        let padded = size.checked_add(p.checked_mul(2)?)?;
        padded.checked_sub(span).map(|r| r / s + 1)
    };
    let (oh, ow) = match (
        out_size(h, kh, stride[0], padding[0], dilation[0]),
        out_size(w, kw, stride[1], padding[1], dilation[1]),
    ) {
        (Some(oh), Some(ow)) => (oh, ow),
        _ => {
            return Err(Error::shape(format!(
                "conv2d: input {x:?} with padding {padding:?} is smaller than the kernel {kh}x{kw} dilated by \
                 {dilation:?}: the output size would be less than 1"
            )))
        }
    };
    let mut direct = kh == 1 && kw == 1 && stride == [1, 1] && padding == [0, 0];
    let kc = c.saturating_mul(kh * kw);
    // One output row of a lane's tiles: its im2col columns (none when direct) and its transposed
    // output-gradient row (or, batched, the output tile's).
    let staged_rows = if limits.staged_weight_grad { o } else { 0 };
    let row_bytes = |direct: bool| {
        (if direct { 0 } else { kc }).saturating_add(staged_rows).saturating_mul(ow).saturating_mul(elem)
    };
    let tile_rows = (limits.tile_bytes / row_bytes(direct).max(1)).clamp(1, oh);
    // Small outputs: whole samples side by side (Note [Batched columns]), within the tile's bytes.
    let positions = oh.saturating_mul(ow);
    let mut batch = 1;
    if limits.batch_columns > positions && tile_rows == oh && n > 1 && positions > 0 {
        let sample_bytes = row_bytes(false).saturating_mul(oh).max(1);
        batch = limits.batch_columns.div_ceil(positions).min(n).min((limits.tile_bytes / sample_bytes).max(1));
        direct &= batch == 1;
    }
    // A lane's weight partial, where the plan stages the weight gradient.
    let weight_bytes = if limits.staged_weight_grad { o.saturating_mul(cg * kh * kw).saturating_mul(elem) } else { 0 };
    let lane_bytes =
        row_bytes(direct).saturating_mul(tile_rows).saturating_mul(batch).saturating_add(weight_bytes).max(1);
    let (lanes, per_lane) = if n == 0 {
        (0, 1)
    } else {
        // Lanes of at least a tile's samples each: batching is what makes small outputs fast.
        let want = (limits.workspace_bytes / lane_bytes).clamp(1, limits.max_lanes.max(1)).min(n.div_ceil(batch));
        let per_lane = n.div_ceil(want);
        (n.div_ceil(per_lane), per_lane)
    };
    let batch = batch.min(per_lane);
    let direct = direct && batch == 1;
    Ok(ConvGeom {
        n,
        c,
        h,
        w,
        o,
        kh,
        kw,
        oh,
        ow,
        sh: stride[0],
        sw: stride[1],
        ph: padding[0],
        pw: padding[1],
        dh: dilation[0],
        dw: dilation[1],
        groups,
        direct,
        depthwise: limits.depthwise_direct && groups == c && groups > 1,
        tile_rows,
        lanes,
        per_lane,
        batch,
        products: crate::Products::F32,
    })
}

/// The work plan of `x`'s convolution by a weight of shape `weight` on `limits`' machine, under
/// the device's products: a depthwise convolution is computed directly only with f32 products (a
/// rounded product's definition is the GEMM door's).
fn plan(x: &Tensor, weight: &[usize], params: &Conv2dParams, limits: Limits) -> Result<ConvGeom> {
    let products = super::products_of(x);
    let g = geometry(x.shape(), weight, params, x.dtype().size(), limits)?;
    Ok(ConvGeom { products, depthwise: g.depthwise && products == crate::Products::F32, ..g })
}

/// `F.conv2d(x, weight, bias, stride, padding, dilation, groups)`: x [N, C, H, W] -> [N, O, OH, OW],
/// OH = floor((H + 2p - d(k-1) - 1)/s) + 1.
pub fn conv2d(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>, params: Conv2dParams) -> Result<Tensor> {
    let _op = x.device().op_scope("conv2d");
    conv2d_with(x, weight, bias, params, limits_for(x.device().target()))
}

/// An optional workspace of `len` elements (none when empty).
fn workspace(like: &Tensor, len: usize, op: &'static str) -> Result<Option<Tensor>> {
    if len == 0 {
        return Ok(None);
    }
    Ok(Some(output(like, &[len], like.dtype(), op)?))
}

fn conv2d_with(
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    params: Conv2dParams,
    limits: Limits,
) -> Result<Tensor> {
    if x.rank() == 3 {
        // Unbatched [C, H, W], as PyTorch accepts.
        return conv2d_with(&x.unsqueeze(0)?, weight, bias, params, limits)?.squeeze(0);
    }
    let mut all = vec![x, weight];
    all.extend(bias);
    check_same("conv2d", &all)?;
    super::check_computable("conv2d", x.dtype())?;
    let g = plan(x, weight.shape(), &params, limits)?;
    if let Some(b) = bias {
        if b.shape() != [g.o] {
            return Err(Error::shape(format!(
                "conv2d: bias {:?} should be [{}] for weight {:?}",
                b.shape(),
                g.o,
                weight.shape()
            )));
        }
    }
    let x = x.contiguous()?;
    let weight = weight.contiguous()?;
    let bias = bias.map(|b| b.contiguous()).transpose()?;
    let out = output(&x, &[g.n, g.o, g.oh, g.ow], x.dtype(), "conv2d")?;
    let ws = workspace(&x, g.lanes * (g.col_len() + g.out_len()), "conv2d_im2col")?;
    x.device().backend().conv2d(&g, &x, &weight, bias.as_ref(), &out, ws.as_ref())?;
    drop(ws);
    let mut inputs = vec![&x, &weight];
    inputs.extend(bias.as_ref());
    if !needs_grad(&inputs) {
        return Ok(out);
    }
    let back = Conv2dBack { x: save_compact(&x)?, weight: save(&weight), has_bias: bias.is_some(), params, limits };
    Ok(record(out, "conv2d", &inputs, back))
}

struct Conv2dBack {
    x: Compact,
    weight: Tensor,
    has_bias: bool,
    params: Conv2dParams,
    limits: Limits,
}

impl Backward for Conv2dBack {
    fn backward(self: Box<Self>, grad: Tensor, needs: &[bool]) -> Result<Vec<Option<Tensor>>> {
        let x = &self.x.restore()?;
        let weight = &self.weight;
        let g = plan(x, weight.shape(), &self.params, self.limits)?;
        if grad.shape() != [g.n, g.o, g.oh, g.ow] || grad.dtype() != x.dtype() {
            return Err(Error::shape(format!(
                "conv2d backward: gradient {:?} {} does not match the output [{}, {}, {}, {}] {}",
                grad.shape(),
                grad.dtype(),
                g.n,
                g.o,
                g.oh,
                g.ow,
                x.dtype()
            )));
        }
        let grad = grad.contiguous()?;
        let need_x = needs.first().copied().unwrap_or(false);
        let need_w = needs.get(1).copied().unwrap_or(false);
        let need_b = self.has_bias && needs.get(2).copied().unwrap_or(false);
        let dx = if need_x { Some(output(&grad, x.shape(), x.dtype(), "conv2d_backward")?) } else { None };
        let dw = if need_w { Some(output(&grad, weight.shape(), x.dtype(), "conv2d_backward")?) } else { None };
        let db = if need_b { Some(output(&grad, &[g.o], x.dtype(), "conv2d_backward")?) } else { None };
        // Per lane: an im2col tile, and for the weight gradient (and batched samples' input gradient)
        // a transposed output-gradient tile.
        let staged = need_w && self.limits.staged_weight_grad && !g.depthwise;
        let lane_len = if staged || g.batch > 1 { g.col_len() + g.gt_len() } else { g.col_len() };
        let ws = if need_x || need_w { workspace(&grad, g.lanes * lane_len, "conv2d_im2col")? } else { None };
        let partials =
            if staged { workspace(&grad, g.lanes * g.weight_len(), "conv2d_weight_partials")? } else { None };
        grad.device().backend().conv2d_backward(
            &g,
            x,
            weight,
            &grad,
            dx.as_ref(),
            dw.as_ref(),
            db.as_ref(),
            partials.as_ref(),
            ws.as_ref(),
        )?;
        drop((ws, partials));
        let mut grads = vec![dx, dw];
        if self.has_bias {
            grads.push(db);
        }
        Ok(grads)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::autograd::backward_with;
    use crate::memory::{Category, EventKind, Phase};
    use crate::ops::softmax::test_support::{assert_close, gradcheck};
    use crate::{DType, Device};

    fn leaf(dev: &Device, data: &[f64], shape: &[usize], grad: bool) -> Tensor {
        let t = Tensor::from_slice(dev, data, shape, Category::Parameter).unwrap();
        if grad {
            t.set_requires_grad(true)
        } else {
            t
        }
    }

    /// Deterministic values in [-1, 1).
    fn values(seed: u64, n: usize) -> Vec<f64> {
        let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (0..n)
            .map(|_| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((s >> 11) as f64 / (1u64 << 53) as f64) * 2.0 - 1.0
            })
            .collect()
    }

    fn params(stride: [usize; 2], padding: [usize; 2], dilation: [usize; 2], groups: usize) -> Conv2dParams {
        Conv2dParams { stride, padding, dilation, groups }
    }

    /// Direct loops, straight from the definition.
    fn naive(x: &[f64], xs: [usize; 4], w: &[f64], ws: [usize; 4], b: Option<&[f64]>, p: Conv2dParams) -> Vec<f64> {
        let [n, c, h, wd] = xs;
        let [o, cg, kh, kw] = ws;
        let og = o / p.groups;
        let oh = (h + 2 * p.padding[0] - p.dilation[0] * (kh - 1) - 1) / p.stride[0] + 1;
        let ow = (wd + 2 * p.padding[1] - p.dilation[1] * (kw - 1) - 1) / p.stride[1] + 1;
        let mut out = vec![0.0; n * o * oh * ow];
        for ni in 0..n {
            for oc in 0..o {
                let gi = oc / og;
                for y in 0..oh {
                    for xo in 0..ow {
                        let mut s = b.map_or(0.0, |b| b[oc]);
                        for ci in 0..cg {
                            let cin = gi * cg + ci;
                            for ki in 0..kh {
                                for kj in 0..kw {
                                    let ih = (y * p.stride[0] + ki * p.dilation[0]) as isize - p.padding[0] as isize;
                                    let iw = (xo * p.stride[1] + kj * p.dilation[1]) as isize - p.padding[1] as isize;
                                    if ih < 0 || iw < 0 || ih as usize >= h || iw as usize >= wd {
                                        continue;
                                    }
                                    s += x[((ni * c + cin) * h + ih as usize) * wd + iw as usize]
                                        * w[((oc * cg + ci) * kh + ki) * kw + kj];
                                }
                            }
                        }
                        out[((ni * o + oc) * oh + y) * ow + xo] = s;
                    }
                }
            }
        }
        let _ = c;
        out
    }

    #[test]
    fn hand_checked_4x4() {
        let dev = Device::cpu();
        let xv: Vec<f64> = (1..=16).map(f64::from).collect();
        let x = leaf(&dev, &xv, &[1, 1, 4, 4], true);
        let w = leaf(&dev, &[1.0; 9], &[1, 1, 3, 3], true);
        let b = leaf(&dev, &[1.0], &[1], true);
        let out = conv2d(&x, &w, Some(&b), Conv2dParams::default()).unwrap();
        assert_eq!(out.shape(), [1, 1, 2, 2]);
        // Window sums 54, 63, 90, 99 plus the bias.
        assert_eq!(out.to_f64_vec().unwrap(), [55.0, 64.0, 91.0, 100.0]);
        backward_with(&out, Tensor::full(&dev, &[1, 1, 2, 2], 1.0, DType::F64, Category::Input).unwrap()).unwrap();
        // Each input position gets one per window covering it.
        let counts = [1., 2., 2., 1., 2., 4., 4., 2., 2., 4., 4., 2., 1., 2., 2., 1.];
        assert_eq!(x.grad().unwrap().to_f64_vec().unwrap(), counts);
        // dW[ki, kj] = x[ki, kj] + x[ki, kj+1] + x[ki+1, kj] + x[ki+1, kj+1] = 16 ki + 4 kj + 14.
        let dw: Vec<f64> = (0..9).map(|k| (16 * (k / 3) + 4 * (k % 3) + 14) as f64).collect();
        assert_eq!(w.grad().unwrap().to_f64_vec().unwrap(), dw);
        assert_eq!(b.grad().unwrap().to_f64_vec().unwrap(), [4.0]);

        // The centre tap with stride 2 and padding 1 samples x[0,0], x[0,2], x[2,0], x[2,2].
        let mut centre = [0.0; 9];
        centre[4] = 1.0;
        let w = leaf(&dev, &centre, &[1, 1, 3, 3], false);
        let out = conv2d(&x, &w, None, params([2, 2], [1, 1], [1, 1], 1)).unwrap();
        assert_eq!(out.to_f64_vec().unwrap(), [1.0, 3.0, 9.0, 11.0]);
        // The top-left tap with padding 1 shifts the image down-right by one, filling zeros.
        let mut corner = [0.0; 9];
        corner[0] = 1.0;
        let w = leaf(&dev, &corner, &[1, 1, 3, 3], false);
        let out = conv2d(&x, &w, None, params([1, 1], [1, 1], [1, 1], 1)).unwrap().to_f64_vec().unwrap();
        let want = [0., 0., 0., 0., 0., 1., 2., 3., 0., 5., 6., 7., 0., 9., 10., 11.];
        assert_eq!(out, want);
    }

    /// (input shape, weight shape, params, bias)
    fn cases() -> Vec<([usize; 4], [usize; 4], Conv2dParams, bool)> {
        vec![
            ([2, 3, 8, 9], [4, 3, 3, 3], params([1, 1], [1, 1], [1, 1], 1), true),
            ([2, 3, 9, 8], [4, 3, 3, 3], params([2, 2], [1, 1], [1, 1], 1), false),
            ([2, 2, 9, 9], [3, 2, 3, 3], params([1, 1], [2, 2], [2, 2], 1), true),
            ([3, 4, 6, 7], [6, 2, 3, 3], params([1, 1], [1, 1], [1, 1], 2), true),
            ([2, 4, 7, 7], [4, 1, 3, 3], params([2, 2], [1, 1], [1, 1], 4), false),
            ([2, 4, 7, 7], [8, 1, 3, 2], params([2, 1], [1, 0], [1, 2], 4), true),
            ([2, 2, 6, 7], [3, 2, 1, 3], params([1, 2], [0, 1], [1, 1], 1), true),
            ([3, 6, 5, 4], [4, 3, 1, 1], params([1, 1], [0, 0], [1, 1], 2), true),
            ([2, 3, 5, 6], [2, 3, 1, 1], params([2, 2], [0, 0], [1, 1], 1), false),
            ([1, 2, 3, 3], [2, 2, 5, 5], params([1, 3], [2, 2], [1, 1], 1), true),
            // Padding wider than a tap's offset at width stride 1: taps 1..pad start inside the
            // padding by less than the padding (the first valid output is pad - offset, not 0).
            ([1, 2, 5, 6], [2, 2, 5, 5], params([1, 1], [2, 2], [1, 1], 1), false),
            // One-dimensional kernels with stride 1 and no padding: not the direct 1x1 path.
            ([2, 3, 6, 5], [4, 3, 3, 1], params([1, 1], [0, 0], [1, 1], 1), true),
            ([2, 2, 5, 6], [3, 2, 1, 3], params([1, 1], [0, 0], [1, 1], 1), false),
            // 1x1 with stride 1 but padding: not direct either.
            ([2, 3, 4, 5], [2, 3, 1, 1], params([1, 1], [1, 1], [1, 1], 1), true),
            // Stride 1 and "same" width, im2col's shifted runs: rows dilated (taps two rows apart),
            // and a plane one column wide under a 3x3 kernel (every side tap in the padding).
            ([2, 3, 7, 6], [4, 3, 3, 3], params([1, 1], [2, 1], [2, 1], 1), true),
            ([3, 2, 3, 1], [3, 2, 3, 3], params([1, 1], [1, 1], [1, 1], 1), false),
        ]
    }

    /// Work plans exercised besides the default: one lane with one output row per tile (threaded
    /// GEMM and im2col), several lanes with weight partials and multi-tile samples, and two lanes of
    /// whole samples side by side (Note [Batched columns]) on every case.
    const SMALL: [Limits; 3] = [
        Limits {
            tile_bytes: 1,
            workspace_bytes: 1,
            max_lanes: 32,
            staged_weight_grad: true,
            batch_columns: 0,
            depthwise_direct: false,
        },
        Limits {
            tile_bytes: 200,
            workspace_bytes: 1 << 20,
            max_lanes: 2,
            staged_weight_grad: true,
            batch_columns: 0,
            depthwise_direct: false,
        },
        Limits {
            tile_bytes: 1 << 20,
            workspace_bytes: 1 << 20,
            max_lanes: 2,
            staged_weight_grad: true,
            batch_columns: 1 << 16,
            depthwise_direct: false,
        },
    ];

    #[test]
    fn forward_matches_naive_loops_for_every_plan() {
        let dev = Device::cpu();
        for (i, (xs, ws, p, bias)) in cases().into_iter().enumerate() {
            let xv = values(i as u64, xs.iter().product());
            let wv = values(100 + i as u64, ws.iter().product());
            let bv = values(200 + i as u64, ws[0]);
            let want = naive(&xv, xs, &wv, ws, bias.then_some(&bv[..]), p);
            let x = leaf(&dev, &xv, &xs, false);
            let w = leaf(&dev, &wv, &ws, false);
            let b = leaf(&dev, &bv, &[ws[0]], false);
            for limits in [LIMITS, SMALL[0], SMALL[1], SMALL[2]] {
                let out = conv2d_with(&x, &w, bias.then_some(&b), p, limits).unwrap();
                assert_close(&out.to_f64_vec().unwrap(), &want, 1e-12, &format!("case {i} {limits:?}"));
                // f32 too.
                let x32 =
                    Tensor::from_slice(&dev, &xv.iter().map(|&v| v as f32).collect::<Vec<_>>(), &xs, Category::Input)
                        .unwrap();
                let w32 =
                    Tensor::from_slice(&dev, &wv.iter().map(|&v| v as f32).collect::<Vec<_>>(), &ws, Category::Input)
                        .unwrap();
                let b32 = Tensor::from_slice(
                    &dev,
                    &bv.iter().map(|&v| v as f32).collect::<Vec<_>>(),
                    &[ws[0]],
                    Category::Input,
                )
                .unwrap();
                let out = conv2d_with(&x32, &w32, bias.then_some(&b32), p, limits).unwrap();
                assert_close(&out.to_f64_vec().unwrap(), &want, 1e-5, &format!("f32 case {i} {limits:?}"));
            }
        }
    }

    /// Samples of few output positions go side by side (Note [Batched columns]): resnet18's last
    /// stage at 28 x 28 (1 x 1 outputs, 512 channels) puts 64 samples in one tile, one lane, and is
    /// not direct (nor a 1x1 of 2 x 2 outputs); 7 x 7 outputs go 6 to a tile; outputs of 256
    /// positions or more, and a GPU target, keep one sample a tile.
    #[test]
    fn small_outputs_put_whole_samples_side_by_side() {
        let padded = Conv2dParams { padding: [1, 1], ..Default::default() };
        let g = geometry(&[64, 512, 1, 1], &[512, 512, 3, 3], &padded, 4, LIMITS).unwrap();
        assert_eq!((g.batch, g.lanes, g.tile_cols(), g.direct), (64, 1, 64, false), "{g:?}");
        let one = geometry(&[64, 256, 2, 2], &[512, 256, 1, 1], &Conv2dParams::default(), 4, LIMITS).unwrap();
        assert_eq!((one.batch, one.lanes, one.direct), (64, 1, false), "{one:?}");
        let seven = geometry(&[64, 64, 7, 7], &[64, 64, 3, 3], &padded, 4, LIMITS).unwrap();
        assert_eq!((seven.batch, seven.tile_cols()), (6, 6 * 49), "{seven:?}");
        let g = geometry(&[64, 16, 16, 16], &[16, 16, 3, 3], &padded, 4, LIMITS).unwrap();
        assert_eq!(g.batch, 1);
        let g = geometry(&[64, 512, 1, 1], &[512, 512, 3, 3], &padded, 4, limits_for(crate::Target::Cuda)).unwrap();
        assert_eq!(g.batch, 1);
    }

    /// A depthwise convolution on the cpu with f32 products is computed directly, with no workspace
    /// (forward and backward); bf16 products, a GPU target and a grouped convolution of several
    /// input channels a group keep im2col.
    #[test]
    fn depthwise_convolutions_need_no_workspace_on_the_cpu_with_f32_products() {
        let dw = Conv2dParams { padding: [1, 1], groups: 96, ..Default::default() };
        let g = geometry(&[32, 96, 32, 32], &[96, 1, 3, 3], &dw, 4, LIMITS).unwrap();
        assert!(g.depthwise, "{g:?}");
        assert_eq!((g.col_len(), g.gt_len(), g.out_len()), (0, 0, 0));
        assert!(!geometry(&[32, 96, 32, 32], &[96, 1, 3, 3], &dw, 4, CUDA_LIMITS).unwrap().depthwise);
        let grouped = Conv2dParams { groups: 48, ..dw };
        assert!(!geometry(&[32, 96, 32, 32], &[96, 2, 3, 3], &grouped, 4, LIMITS).unwrap().depthwise);
        // What the op allocates: outputs and gradients only; under bf16 products, im2col's too.
        let allocations = |products: crate::Products| {
            let dev = Device::cpu();
            dev.set_products(products).unwrap();
            let x =
                Tensor::full(&dev, &[4, 6, 8, 8], 0.5, DType::F32, Category::Input).unwrap().set_requires_grad(true);
            let w = Tensor::full(&dev, &[6, 1, 3, 3], 0.25, DType::F32, Category::Parameter)
                .unwrap()
                .set_requires_grad(true);
            let out = conv2d(&x, &w, None, Conv2dParams { padding: [1, 1], groups: 6, ..Default::default() }).unwrap();
            backward_with(&out, Tensor::full(&dev, out.shape(), 1.0, DType::F32, Category::Input).unwrap()).unwrap();
            let events = dev.allocator().timeline().events().map(|e| e.op).collect::<Vec<_>>();
            events.iter().any(|op| *op == "conv2d_im2col" || *op == "conv2d_weight_partials")
        };
        assert!(!allocations(crate::Products::F32), "a depthwise convolution with f32 products used a workspace");
        assert!(allocations(crate::Products::Bf16), "bf16 products go through im2col");
    }

    #[test]
    fn the_small_plans_really_tile_and_split() {
        let g = geometry(&[5, 3, 8, 9], &[4, 3, 3, 3], &params([1, 1], [1, 1], [1, 1], 1), 8, SMALL[0]).unwrap();
        assert_eq!((g.lanes, g.tile_rows), (1, 1));
        let g = geometry(&[5, 3, 8, 9], &[4, 3, 3, 3], &params([1, 1], [1, 1], [1, 1], 1), 8, SMALL[1]).unwrap();
        assert_eq!((g.lanes, g.per_lane, g.tile_rows), (2, 3, 1));
        let g = geometry(
            &[64, 32, 32, 32],
            &[64, 32, 3, 3],
            &Conv2dParams { padding: [1, 1], ..Default::default() },
            4,
            LIMITS,
        )
        .unwrap();
        assert!(g.lanes > 1 && g.tile_rows == 32, "{g:?}");
    }

    /// A tile holds whole output rows of all C * kh * kw im2col columns (plus the gradient's O), and
    /// lanes are added while their tiles and whole-weight partials fit the workspace.
    #[test]
    fn the_plan_sizes_tiles_and_lanes_from_the_whole_kernel() {
        let padded = Conv2dParams { padding: [1, 1], ..Default::default() };
        // f32, C 64, 3x3, O 64, W 64: a row is (576 + 64) * 64 * 4 = 163840 bytes; 4 MiB holds 25.
        let g = geometry(&[1, 64, 64, 64], &[64, 64, 3, 3], &padded, 4, LIMITS).unwrap();
        assert_eq!(g.tile_rows, 25);
        // C 16, O 256, 8x8: a tile is all 8 rows, (144 + 256) * 8 * 4 * 8 = 102400 bytes, and the
        // weight 256 * 144 * 4 = 147456; 1 MiB holds 4 such lanes, so 12 samples go 3 to a lane.
        let limits = Limits {
            tile_bytes: 4 << 20,
            workspace_bytes: 1 << 20,
            max_lanes: 32,
            staged_weight_grad: true,
            batch_columns: 0,
            depthwise_direct: false,
        };
        let g = geometry(&[12, 16, 8, 8], &[256, 16, 3, 3], &padded, 4, limits).unwrap();
        assert_eq!((g.tile_rows, g.lanes, g.per_lane), (8, 4, 3));
    }

    /// A GPU target plans im2col columns only: no transposed gradient tile and no weight partials, in
    /// forward and backward, with as many lanes as the workspace holds (a lane of a large image's
    /// rows, or a whole small sample each); a cpu target stages the weight gradient.
    #[test]
    fn a_gpu_target_plans_lanes_of_columns_and_no_weight_partials() {
        let padded = Conv2dParams { padding: [1, 1], ..Default::default() };
        let g = geometry(&[64, 64, 64, 64], &[64, 64, 3, 3], &padded, 4, limits_for(crate::Target::Cuda)).unwrap();
        // A row of im2col columns alone: 576 * 64 * 4 = 147456 bytes; 4 MiB holds 28 rows.
        assert_eq!((g.lanes, g.per_lane, g.tile_rows), (1, 64, 28));
        let ops = |device: &Device| {
            let x = leaf(device, &values(3, 2 * 3 * 6 * 6), &[2, 3, 6, 6], true);
            let w = leaf(device, &values(4, 4 * 3 * 9), &[4, 3, 3, 3], true);
            let out = conv2d(&x, &w, None, padded).unwrap();
            backward_with(&out, Tensor::full(device, out.shape(), 1.0, DType::F64, Category::Input).unwrap()).unwrap();
            let events = device.timeline_events();
            let sizes = |op: &str| {
                events.iter().filter(|e| e.kind == EventKind::Alloc && e.op == op).map(|e| e.bytes).collect::<Vec<_>>()
            };
            (sizes("conv2d_im2col"), sizes("conv2d_weight_partials"))
        };
        // Blocks are whole 512-byte units. Forward's tiles and backward's: 27 columns x 36 positions,
        // one per sample (both lanes at once).
        let block = |bytes: u64| bytes.div_ceil(512) * 512;
        let gpu = Device::new(crate::DeviceConfig::new(crate::DeviceKind::Meta(crate::Target::Cuda))).unwrap();
        assert_eq!(ops(&gpu), (vec![block(2 * 27 * 36 * 8); 2], vec![]));
        let small = geometry(&[128, 1, 28, 28], &[16, 1, 3, 3], &padded, 4, limits_for(crate::Target::Cuda)).unwrap();
        // simplecnn's batch: 28,224 bytes a sample, so 1 MiB takes 37 lanes: 32 lanes of 4 samples.
        assert_eq!((small.lanes, small.per_lane, small.tile_rows), (32, 4, 28), "simplecnn's batch in 4 steps");
        // The cpu puts both samples (36 positions each) side by side in one lane (Note [Batched
        // columns]): forward's im2col and output tiles, backward's im2col and gradient tiles.
        let (cpu_tiles, cpu_partials) = ops(&Device::meta());
        assert_eq!(cpu_tiles, vec![block((27 + 4) * 72 * 8); 2], "one lane of both samples");
        assert_eq!(cpu_partials, vec![block(4 * 27 * 8)]);
    }

    /// Backward allocates only the gradients asked for: none for a bias that needs none.
    #[test]
    fn backward_skips_the_gradient_of_a_bias_that_needs_none() {
        let dev = Device::cpu();
        let x = leaf(&dev, &values(1, 16), &[1, 1, 4, 4], true);
        let w = leaf(&dev, &values(2, 4), &[1, 1, 2, 2], true);
        let b = leaf(&dev, &[0.5], &[1], false);
        let out = conv2d(&x, &w, Some(&b), Conv2dParams::default()).unwrap();
        backward_with(&out, Tensor::full(&dev, out.shape(), 1.0, DType::F64, Category::Input).unwrap()).unwrap();
        let grads = dev
            .timeline_events()
            .iter()
            .filter(|e| e.kind == EventKind::Alloc && e.op == "conv2d_backward")
            .map(|e| e.bytes)
            .collect::<Vec<_>>();
        assert_eq!(grads.len(), 2, "dx and dw only: {grads:?}");
        assert!(x.grad().is_some() && w.grad().is_some() && b.grad().is_none());
    }

    /// Autograd checks an output gradient's shape, not its dtype: backward does.
    #[test]
    fn backward_refuses_a_gradient_of_another_dtype() {
        let dev = Device::cpu();
        let x = leaf(&dev, &values(1, 16), &[1, 1, 4, 4], true);
        let w = leaf(&dev, &values(2, 4), &[1, 1, 2, 2], true);
        let out = conv2d(&x, &w, None, Conv2dParams::default()).unwrap();
        let seed = Tensor::full(&dev, out.shape(), 1.0, DType::F32, Category::Input).unwrap();
        let err = backward_with(&out, seed).unwrap_err();
        assert!(err.to_string().contains("conv2d backward: gradient [1, 1, 3, 3] f32 does not match"), "{err}");
    }

    #[test]
    fn gradients_match_finite_differences() {
        let variants = [
            ([2, 2, 5, 6], [3, 2, 3, 3], params([2, 2], [1, 1], [1, 1], 1), true),
            ([2, 2, 7, 7], [2, 2, 3, 3], params([1, 1], [1, 1], [2, 2], 1), true),
            ([2, 4, 5, 5], [4, 2, 3, 3], params([1, 1], [1, 1], [1, 1], 2), true),
            ([2, 4, 6, 5], [4, 1, 2, 3], params([2, 1], [1, 1], [2, 1], 4), false),
            ([2, 4, 3, 4], [2, 2, 1, 1], params([1, 1], [0, 0], [1, 1], 2), true),
            // More than eight output channels (the gradient transpose works in blocks of eight).
            ([2, 2, 4, 5], [10, 2, 3, 3], params([1, 1], [1, 1], [1, 1], 1), true),
            // Depthwise with two outputs a channel and rows of 10 (the weight gradient's whole
            // groups of lanes), and strided.
            ([2, 3, 9, 10], [6, 1, 3, 3], params([1, 1], [1, 1], [1, 1], 3), true),
            ([2, 3, 9, 10], [3, 1, 3, 3], params([2, 2], [1, 1], [1, 1], 3), false),
        ];
        for (i, (xs, ws, p, bias)) in variants.into_iter().enumerate() {
            let mut inputs = vec![
                (values(10 + i as u64, xs.iter().product()), xs.to_vec()),
                (values(20 + i as u64, ws.iter().product()), ws.to_vec()),
            ];
            if bias {
                inputs.push((values(30 + i as u64, ws[0]), vec![ws[0]]));
            }
            for limits in [LIMITS, SMALL[0], SMALL[1], SMALL[2]] {
                gradcheck(&inputs, |t| conv2d_with(&t[0], &t[1], t.get(2), p, limits));
            }
        }
    }

    type Events = Vec<(EventKind, u64, Category, &'static str, Phase)>;

    /// Runs conv2d forward and backward; returns the allocator's events and peak.
    fn program(dev: &Device, limits: Limits, input_grad: bool) -> (Events, u64) {
        let x =
            Tensor::full(dev, &[5, 4, 9, 8], 0.5, DType::F32, Category::Input).unwrap().set_requires_grad(input_grad);
        let w =
            Tensor::full(dev, &[6, 2, 3, 3], 0.25, DType::F32, Category::Parameter).unwrap().set_requires_grad(true);
        let b = Tensor::full(dev, &[6], 0.1, DType::F32, Category::Parameter).unwrap().set_requires_grad(true);
        {
            let _phase = dev.enter_phase(Phase::Forward);
            let out = conv2d_with(&x, &w, Some(&b), params([2, 1], [1, 2], [1, 2], 2), limits).unwrap();
            let seed = Tensor::full(dev, out.shape(), 1.0, DType::F32, Category::Temporary).unwrap();
            backward_with(&out, seed).unwrap();
        }
        let a = dev.allocator();
        let events = a.timeline().events().map(|e| (e.kind, e.bytes, e.category, e.op, e.phase)).collect();
        (events, a.stats().allocated_bytes.peak)
    }

    #[test]
    fn meta_allocates_what_cpu_allocates() {
        for limits in [LIMITS, SMALL[0], SMALL[1], SMALL[2]] {
            for input_grad in [false, true] {
                let cpu = program(&Device::cpu(), limits, input_grad);
                let meta = program(&Device::meta(), limits, input_grad);
                assert_eq!(cpu, meta, "{limits:?}");
                assert!(cpu.0.iter().any(|e| e.3 == "conv2d_im2col" && e.4 == Phase::Backward));
                // grad input, weight, bias; the input's only when it wants one.
                let grads = cpu.0.iter().filter(|e| e.0 == EventKind::Alloc && e.3 == "conv2d_backward").count();
                assert_eq!(grads, 2 + input_grad as usize);
            }
        }
    }

    #[test]
    fn workspace_does_not_depend_on_the_thread_count() {
        let run = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            pool.install(|| program(&Device::cpu(), LIMITS, true))
        };
        assert_eq!(run(1), run(3));
    }

    /// The output and every gradient have the same bits on one thread and on three, for every work
    /// plan: lanes add their weight partials in lane order, and each channel of im2col and col2im is
    /// one task's.
    #[test]
    fn results_do_not_depend_on_the_thread_count() {
        for (i, (xs, ws, p, bias)) in cases().into_iter().enumerate() {
            for limits in [LIMITS, SMALL[0], SMALL[1], SMALL[2]] {
                let run = |threads: usize| {
                    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
                    pool.install(|| {
                        let dev = Device::cpu();
                        let f32s = |seed: u64, n: usize| values(seed, n).iter().map(|&v| v as f32).collect::<Vec<_>>();
                        let leaf32 = |v: Vec<f32>, shape: &[usize]| {
                            Tensor::from_slice(&dev, &v, shape, Category::Input).unwrap().set_requires_grad(true)
                        };
                        let x = leaf32(f32s(i as u64, xs.iter().product()), &xs);
                        let w = leaf32(f32s(100 + i as u64, ws.iter().product()), &ws);
                        let b = leaf32(f32s(200 + i as u64, ws[0]), &[ws[0]]);
                        let out = conv2d_with(&x, &w, bias.then_some(&b), p, limits).unwrap();
                        let seed = leaf32(f32s(300 + i as u64, out.numel()), out.shape());
                        backward_with(&out, seed).unwrap();
                        let bits =
                            |t: &Tensor| t.to_vec::<f32>().unwrap().iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                        [bits(&out), bits(&x.grad().unwrap()), bits(&w.grad().unwrap())]
                    })
                };
                assert_eq!(run(1), run(3), "case {i} {limits:?}");
            }
        }
    }

    #[test]
    fn shape_errors_are_clear() {
        let dev = Device::cpu();
        let x = Tensor::zeros(&dev, &[1, 4, 5, 5], DType::F32, Category::Input).unwrap();
        let err = |w: &[usize], b: Option<&[usize]>, p: Conv2dParams| {
            let w = Tensor::zeros(&dev, w, DType::F32, Category::Input).unwrap();
            let b = b.map(|s| Tensor::zeros(&dev, s, DType::F32, Category::Input).unwrap());
            conv2d(&x, &w, b.as_ref(), p).unwrap_err().to_string()
        };
        assert!(err(&[2, 4, 3, 3], None, params([1, 1], [0, 0], [1, 1], 3)).contains("does not divide"));
        assert!(err(&[3, 2, 3, 3], None, params([1, 1], [0, 0], [1, 1], 2)).contains("does not divide"));
        assert!(err(&[2, 4, 3, 3], None, params([1, 1], [0, 0], [1, 1], 2)).contains("input channels per group"));
        assert!(err(&[2, 4, 6, 3], None, Conv2dParams::default()).contains("less than 1"));
        assert!(err(&[2, 4, 3, 3], None, params([1, 1], [0, 0], [3, 3], 1)).contains("less than 1"));
        assert!(err(&[2, 4, 3, 3], Some(&[3]), Conv2dParams::default()).contains("bias"));
        assert!(err(&[2, 4, 3, 3], None, params([0, 1], [0, 0], [1, 1], 1)).contains("stride"));
        assert!(err(&[2, 4, 3], None, Conv2dParams::default()).contains("weight must be"));
        let x2 = Tensor::zeros(&dev, &[4, 5], DType::F32, Category::Input).unwrap();
        let w = Tensor::zeros(&dev, &[2, 4, 3, 3], DType::F32, Category::Input).unwrap();
        assert!(conv2d(&x2, &w, None, Conv2dParams::default()).unwrap_err().to_string().contains("input must be"));
        let w64 = Tensor::zeros(&dev, &[2, 4, 3, 3], DType::F64, Category::Input).unwrap();
        assert!(conv2d(&x, &w64, None, Conv2dParams::default()).is_err());
        // Unbatched input works like a batch of one.
        let x3 = Tensor::full(&dev, &[4, 5, 5], 1.0, DType::F32, Category::Input).unwrap();
        let w1 = Tensor::full(&dev, &[2, 4, 3, 3], 1.0, DType::F32, Category::Input).unwrap();
        let out = conv2d(&x3, &w1, None, Conv2dParams::default()).unwrap();
        assert_eq!(out.shape(), [2, 3, 3]);
        assert_eq!(out.to_f64_vec().unwrap(), vec![36.0; 18]);
    }

    #[test]
    fn empty_batch_gives_empty_output_and_zero_weight_gradient() {
        let dev = Device::cpu();
        let x = Tensor::zeros(&dev, &[0, 2, 5, 5], DType::F64, Category::Input).unwrap();
        let w = leaf(&dev, &[1.0; 36], &[2, 2, 3, 3], true);
        let out = conv2d(&x, &w, None, Conv2dParams::default()).unwrap();
        assert_eq!(out.shape(), [0, 2, 3, 3]);
        backward_with(&out, Tensor::zeros(&dev, &[0, 2, 3, 3], DType::F64, Category::Input).unwrap()).unwrap();
        assert_eq!(w.grad().unwrap().to_f64_vec().unwrap(), vec![0.0; 36]);
        // No input channels: the output is the bias alone, and the weight gradient is empty.
        let x = leaf(&dev, &[], &[1, 0, 4, 4], true);
        let w = leaf(&dev, &[], &[2, 0, 3, 3], true);
        let b = leaf(&dev, &[0.5, -1.0], &[2], true);
        let out = conv2d(&x, &w, Some(&b), Conv2dParams::default()).unwrap();
        assert_eq!(out.to_f64_vec().unwrap(), [[0.5; 4], [-1.0; 4]].concat());
        backward_with(&out, Tensor::full(&dev, &[1, 2, 2, 2], 1.0, DType::F64, Category::Input).unwrap()).unwrap();
        assert_eq!((w.grad().unwrap().numel(), b.grad().unwrap().to_f64_vec().unwrap()), (0, vec![4.0, 4.0]));
    }

    fn golden_dir() -> Option<std::path::PathBuf> {
        let dir = std::path::PathBuf::from(crate::ops::softmax::test_support::GOLDEN_DIR);
        assert!(dir.join("manifest.json").exists(), "golden data missing at {}", dir.display());
        Some(dir)
    }

    /// Values of one golden tensor as f64.
    pub(crate) fn golden_values(st: &safetensors::SafeTensors, key: &str) -> (Vec<f64>, Vec<usize>) {
        let v = st.tensor(key).unwrap_or_else(|e| panic!("{key}: {e}"));
        let d = v.data();
        let vals = match v.dtype() {
            safetensors::Dtype::F32 => {
                d.chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap()) as f64).collect()
            }
            safetensors::Dtype::F64 => d.chunks_exact(8).map(|b| f64::from_le_bytes(b.try_into().unwrap())).collect(),
            safetensors::Dtype::I64 => {
                d.chunks_exact(8).map(|b| i64::from_le_bytes(b.try_into().unwrap()) as f64).collect()
            }
            other => panic!("{key}: unexpected dtype {other:?}"),
        };
        (vals, v.shape().to_vec())
    }

    fn golden_tensor(dev: &Device, st: &safetensors::SafeTensors, key: &str, dtype: DType) -> Tensor {
        let (v, s) = golden_values(st, key);
        match dtype {
            DType::F32 => {
                Tensor::from_slice(dev, &v.iter().map(|&x| x as f32).collect::<Vec<_>>(), &s, Category::Input).unwrap()
            }
            _ => Tensor::from_slice(dev, &v, &s, Category::Input).unwrap(),
        }
    }

    fn within(got: &[f64], want: &[f64], rtol: f64, what: &str) {
        assert_eq!(got.len(), want.len(), "{what}");
        let atol = rtol * want.iter().fold(0.0f64, |m, v| m.max(v.abs()));
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!((g - w).abs() <= rtol * w.abs() + atol, "{what}[{i}]: got {g}, want {w}");
        }
    }

    #[test]
    fn matches_pytorch_golden_data() {
        let Some(dir) = golden_dir() else { return };
        let manifest: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.join("manifest.json")).unwrap()).unwrap();
        let bytes = std::fs::read(dir.join("conv2d.safetensors")).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let dev = Device::cpu();
        let mut seen = 0;
        for case in manifest["cases"].as_array().unwrap() {
            if case["file"] != "conv2d.safetensors" {
                continue;
            }
            let name = case["name"].as_str().unwrap();
            let (dtype, rtol) = if case["dtype"] == "float32" { (DType::F32, 1e-5) } else { (DType::F64, 1e-10) };
            let a = &case["attrs"];
            let pair = |k: &str| [a[k][0].as_u64().unwrap() as usize, a[k][1].as_u64().unwrap() as usize];
            let p = params(pair("stride"), pair("padding"), pair("dilation"), a["groups"].as_u64().unwrap() as usize);
            let mut args = std::collections::HashMap::new();
            for t in case["tensors"].as_array().unwrap() {
                if let Some(arg) = t["arg"].as_str() {
                    let tensor = golden_tensor(&dev, &st, t["key"].as_str().unwrap(), dtype);
                    args.insert(arg.to_string(), tensor.set_requires_grad(t["requires_grad"] == true));
                }
            }
            let out = conv2d(&args["input"], &args["weight"], args.get("bias"), p).unwrap();
            within(&out.to_f64_vec().unwrap(), &golden_values(&st, &format!("{name}/output")).0, rtol, name);
            let seed = golden_tensor(&dev, &st, &format!("{name}/grad_out"), dtype);
            backward_with(&out, seed).unwrap();
            for t in case["tensors"].as_array().unwrap() {
                if t["role"] == "grad" {
                    let wrt = t["wrt"].as_str().unwrap();
                    let got = args[wrt].grad().unwrap().to_f64_vec().unwrap();
                    within(&got, &golden_values(&st, t["key"].as_str().unwrap()).0, rtol, &format!("{name} d{wrt}"));
                }
            }
            seen += 1;
        }
        assert!(seen >= 10, "only {seen} conv2d golden cases");
    }
}
