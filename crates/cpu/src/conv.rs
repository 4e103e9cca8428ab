//! CPU kernels of 2-D convolution (`ops/conv.rs`): im2col / col2im, the per-lane GEMM loops of the
//! forward and of the input and weight gradients, the lane-ordered sum of the weight partials and the
//! bias gradient. The work plan (lanes, tiles, workspace sizes) is the op's [`ConvGeom`]; these
//! kernels only follow it (Note [conv2d work plan] in `ops/conv.rs`).

use super::gemm::{gemm_into, Mat, Products, SendPtr};
use crate::dtype::Float;
use crate::error::{check_len, Result};
use crate::view::View;
use crate::with_float;
use rayon::prelude::*;
use std::ops::Range;

/// The shapes of one convolution and its work plan.
#[derive(Clone, Copy, Debug)]
pub struct ConvGeom {
    pub n: usize,
    pub c: usize,
    pub h: usize,
    pub w: usize,
    pub o: usize,
    pub kh: usize,
    pub kw: usize,
    pub oh: usize,
    pub ow: usize,
    pub sh: usize,
    pub sw: usize,
    pub ph: usize,
    pub pw: usize,
    pub dh: usize,
    pub dw: usize,
    pub groups: usize,
    /// 1x1 kernel, stride 1, no padding: the input is its own im2col matrix.
    pub direct: bool,
    /// Output rows per im2col tile.
    pub tile_rows: usize,
    /// Parallel lanes (0 for an empty batch).
    pub lanes: usize,
    /// Samples per lane (the last lane may have fewer).
    pub per_lane: usize,
    /// Whole samples per im2col tile, side by side (Note [Batched columns] in `ops/conv.rs`); 1: a
    /// tile is `tile_rows` output rows of one sample.
    pub batch: usize,
    /// How the products compute (the device's setting).
    pub products: Products,
}

impl ConvGeom {
    pub fn cg(&self) -> usize {
        self.c / self.groups
    }
    pub fn og(&self) -> usize {
        self.o / self.groups
    }
    /// GEMM depth per group: rows of the im2col matrix of one group.
    pub fn kg(&self) -> usize {
        self.cg() * self.kh * self.kw
    }
    /// Rows of the im2col matrix of all groups.
    pub fn kc(&self) -> usize {
        self.c * self.kh * self.kw
    }
    pub fn hw(&self) -> usize {
        self.h * self.w
    }
    pub fn p(&self) -> usize {
        self.oh * self.ow
    }
    /// Columns of one im2col tile: `tile_rows` output rows of a sample, or `batch` whole samples.
    pub fn tile_cols(&self) -> usize {
        self.tile_rows * self.ow * self.batch.max(1)
    }
    /// Elements of one lane's im2col tile.
    pub fn col_len(&self) -> usize {
        if self.direct {
            0
        } else {
            self.kc() * self.tile_cols()
        }
    }
    /// Elements of one lane's transposed output-gradient tile `[columns, O]` (the weight gradient's;
    /// with batched samples the input gradient reads it too).
    pub fn gt_len(&self) -> usize {
        self.o * self.tile_cols()
    }
    /// Elements of one lane's output tile `[O, columns]` (batched samples only: their outputs are
    /// scattered from it).
    pub fn out_len(&self) -> usize {
        if self.batch > 1 {
            self.o * self.tile_cols()
        } else {
            0
        }
    }
    pub fn weight_len(&self) -> usize {
        self.o * self.kg()
    }
    pub fn samples(&self, lane: usize) -> Range<usize> {
        (lane * self.per_lane).min(self.n)..((lane + 1) * self.per_lane).min(self.n)
    }
    /// Output-row ranges of the tiles of one sample.
    pub fn tiles(&self) -> impl Iterator<Item = (usize, usize)> {
        let (rows, oh) = (self.tile_rows, self.oh);
        (0..oh).step_by(rows.max(1)).map(move |r0| (r0, (r0 + rows).min(oh)))
    }
}

/// `out = conv2d(x, weight) (+ bias)` for x `[N, C, H, W]` (all contiguous), using the op's im2col
/// workspace (`lanes * col_len` elements; none for a direct 1x1 convolution).
pub fn conv2d(
    g: &ConvGeom,
    x: View<'_>,
    weight: View<'_>,
    bias: Option<View<'_>>,
    out: View<'_>,
    workspace: Option<View<'_>>,
) -> Result<()> {
    with_float!(x.dtype(), "conv2d", T => {
        let b = match bias {
            Some(b) => Some(b.slice::<T>()?),
            None => None,
        };
        let ws = match workspace {
            Some(t) => Some(t.slice_mut::<T>()?),
            None => None,
        };
        let out = out.slice_mut::<T>()?;
        check_len("conv2d output", out.len(), g.n * g.o * g.p())?;
        let lane_len = g.col_len() + g.out_len();
        check_len("conv2d im2col workspace", ws.as_ref().map_or(0, |s| s.len()), g.lanes * lane_len)?;
        match g.batch > 1 {
            true => forward_batched::<T>(g, x.slice::<T>()?, weight.slice::<T>()?, b, out, ws),
            false => forward_kernel::<T>(g, x.slice::<T>()?, weight.slice::<T>()?, b, out, ws),
        }
    });
    Ok(())
}

/// The gradients of conv2d that are asked for (`dx`, `dw`, `db`), from the output gradient `grad`
/// (contiguous), with the op's workspaces: per lane an im2col tile (and, for `dw`, a transposed
/// output-gradient tile), and the per-lane weight-gradient partials (for `dw`).
#[allow(clippy::too_many_arguments)]
pub fn conv2d_backward(
    g: &ConvGeom,
    x: View<'_>,
    weight: View<'_>,
    grad: View<'_>,
    dx: Option<View<'_>>,
    dw: Option<View<'_>>,
    db: Option<View<'_>>,
    partials: Option<View<'_>>,
    workspace: Option<View<'_>>,
) -> Result<()> {
    with_float!(x.dtype(), "conv2d_backward", T => {
        let gout = grad.slice::<T>()?;
        if dx.is_some() || dw.is_some() {
            let dxs = match dx {
                Some(t) => Some(t.slice_mut::<T>()?),
                None => None,
            };
            let dws = match dw {
                Some(t) => Some(t.slice_mut::<T>()?),
                None => None,
            };
            let ps = match partials {
                Some(t) => Some(t.slice_mut::<T>()?),
                None => None,
            };
            let wss = match workspace {
                Some(t) => Some(t.slice_mut::<T>()?),
                None => None,
            };
            let len = |s: &Option<&mut [T]>| s.as_ref().map_or(0, |s| s.len());
            if dxs.is_some() {
                check_len("conv2d input gradient", len(&dxs), g.n * g.c * g.hw())?;
            }
            let gt_len = if dws.is_some() || g.batch > 1 { g.gt_len() } else { 0 };
            check_len("conv2d im2col workspace", len(&wss), g.lanes * (g.col_len() + gt_len))?;
            if dws.is_some() {
                check_len("conv2d weight-gradient partials", len(&ps), g.lanes * g.weight_len())?;
            }
            match g.batch > 1 {
                true => backward_batched::<T>(g, x.slice::<T>()?, weight.slice::<T>()?, gout, dxs, dws, ps, wss),
                false => backward_kernel::<T>(g, x.slice::<T>()?, weight.slice::<T>()?, gout, dxs, dws, ps, wss),
            }
        }
        if let Some(db) = db {
            bias_grad::<T>(g, gout, db.slice_mut::<T>()?);
        }
    });
    Ok(())
}

/// Runs `f(lane, gemm_threads)` for every lane: lanes in parallel with single-threaded GEMMs, or one
/// lane with every thread.
fn run_lanes(lanes: usize, f: impl Fn(usize, usize) + Sync) {
    match lanes {
        0 => {}
        1 => f(0, rayon::current_num_threads()),
        _ => (0..lanes).into_par_iter().for_each(|lane| f(lane, 1)),
    }
}

/// Output positions `o` in `0..out` whose input position `o*stride + off - pad` lies in `0..size`.
fn valid_range(off: usize, pad: usize, stride: usize, size: usize, out: usize) -> (usize, usize) {
    let lo = if off >= pad { 0 } else { (pad - off).div_ceil(stride) };
    let hi = if size + pad <= off { 0 } else { (size + pad - off).div_ceil(stride) };
    let lo = lo.min(out);
    (lo, hi.clamp(lo, out))
}

/// Writes the im2col tile of output rows `r0..r1` of one sample: `col[(c, ki, kj), (oh, ow)]` =
/// `x[c, oh*sh + ki*dh - ph, ow*sw + kj*dw - pw]` (0 in the padding).
fn im2col<T: Float>(g: &ConvGeom, xn: &[T], r0: usize, r1: usize, col: &mut [T], parallel: bool) {
    let tp = (r1 - r0) * g.ow;
    im2col_into(g, xn, r0, r1, col, tp, 0, parallel);
}

/// [`im2col`] into columns `c0..c0 + (r1-r0)*OW` of a tile whose rows are `rs` long (samples side by
/// side: Note [Batched columns] in `ops/conv.rs`).
#[allow(clippy::too_many_arguments)]
fn im2col_into<T: Float>(
    g: &ConvGeom,
    xn: &[T],
    r0: usize,
    r1: usize,
    col: &mut [T],
    rs: usize,
    c0: usize,
    parallel: bool,
) {
    let (ow, tp, hw) = (g.ow, (r1 - r0) * g.ow, g.hw());
    let per_channel = g.kh * g.kw * rs;
    let channel = |(ci, dst): (usize, &mut [T])| {
        let plane = &xn[ci * hw..(ci + 1) * hw];
        for ki in 0..g.kh {
            for kj in 0..g.kw {
                let row = &mut dst[(ki * g.kw + kj) * rs + c0..][..tp];
                let (lo, hi) = valid_range(kj * g.dw, g.pw, g.sw, g.w, ow);
                for (t, orow) in (r0..r1).enumerate() {
                    let seg = &mut row[t * ow..(t + 1) * ow];
                    let ih = orow * g.sh + ki * g.dh;
                    if ih < g.ph || ih - g.ph >= g.h || lo == hi {
                        seg.fill(T::zero());
                        continue;
                    }
                    let src = &plane[(ih - g.ph) * g.w..][..g.w];
                    seg[..lo].fill(T::zero());
                    seg[hi..].fill(T::zero());
                    // Input column of output column `lo` (>= 0 by construction of `lo`).
                    let s0 = lo * g.sw + kj * g.dw - g.pw;
                    if g.sw == 1 {
                        seg[lo..hi].copy_from_slice(&src[s0..s0 + (hi - lo)]);
                    } else {
                        for (d, s) in seg[lo..hi].iter_mut().zip(src[s0..].iter().step_by(g.sw)) {
                            *d = *s;
                        }
                    }
                }
            }
        }
    };
    let col = &mut col[..g.c * per_channel];
    if parallel {
        col.par_chunks_mut(per_channel).enumerate().for_each(channel);
    } else {
        col.chunks_mut(per_channel).enumerate().for_each(channel);
    }
}

/// Adds an im2col-shaped tile (output rows `r0..r1`) back onto the input positions it was read from.
fn col2im<T: Float>(g: &ConvGeom, col: &[T], r0: usize, r1: usize, dxn: &mut [T], parallel: bool) {
    let tp = (r1 - r0) * g.ow;
    col2im_from(g, col, r0, r1, dxn, tp, 0, parallel);
}

/// [`col2im`] from columns `c0..` of a tile whose rows are `rs` long.
#[allow(clippy::too_many_arguments)]
fn col2im_from<T: Float>(
    g: &ConvGeom,
    col: &[T],
    r0: usize,
    r1: usize,
    dxn: &mut [T],
    rs: usize,
    c0: usize,
    parallel: bool,
) {
    let (ow, tp, hw) = (g.ow, (r1 - r0) * g.ow, g.hw());
    if hw == 0 {
        return;
    }
    let per_channel = g.kh * g.kw * rs;
    let channel = |(plane, src): (&mut [T], &[T])| {
        for ki in 0..g.kh {
            for kj in 0..g.kw {
                let row = &src[(ki * g.kw + kj) * rs + c0..][..tp];
                let (lo, hi) = valid_range(kj * g.dw, g.pw, g.sw, g.w, ow);
                if lo == hi {
                    continue;
                }
                for (t, orow) in (r0..r1).enumerate() {
                    let ih = orow * g.sh + ki * g.dh;
                    if ih < g.ph || ih - g.ph >= g.h {
                        continue;
                    }
                    let seg = &row[t * ow..(t + 1) * ow];
                    let dst = &mut plane[(ih - g.ph) * g.w..][..g.w];
                    let s0 = lo * g.sw + kj * g.dw - g.pw;
                    if g.sw == 1 {
                        for (d, s) in dst[s0..s0 + (hi - lo)].iter_mut().zip(&seg[lo..hi]) {
                            *d += *s;
                        }
                    } else {
                        for (d, s) in dst[s0..].iter_mut().step_by(g.sw).zip(&seg[lo..hi]) {
                            *d += *s;
                        }
                    }
                }
            }
        }
    };
    let dxn = &mut dxn[..g.c * hw];
    let col = &col[..g.c * per_channel];
    if parallel {
        dxn.par_chunks_mut(hw).zip(col.par_chunks(per_channel)).for_each(channel);
    } else {
        dxn.chunks_mut(hw).zip(col.chunks(per_channel)).for_each(channel);
    }
}

/// The im2col matrix of output rows `r0..r1` of one sample, as (pointer, row stride): the input
/// itself for a direct (1x1) convolution, else the lane's tile after filling it.
fn tile_source<T: Float>(
    g: &ConvGeom,
    xn: &[T],
    r0: usize,
    r1: usize,
    col: &mut [T],
    threads: usize,
) -> (*const T, usize) {
    if g.direct {
        (xn[r0 * g.ow..].as_ptr(), g.hw())
    } else {
        im2col(g, xn, r0, r1, col, threads > 1);
        (col.as_ptr(), (r1 - r0) * g.ow)
    }
}

/// `gt[t, oc] = gn[oc, c0 + t]` for the `tp` columns of a tile. Eight source rows at a time, so
/// each destination row gets eight contiguous values per visit.
fn transpose_tile<T: Float>(gn: &[T], o: usize, p: usize, c0: usize, tp: usize, gt: &mut [T]) {
    if o == 0 {
        return;
    }
    let gt = &mut gt[..tp * o];
    let mut oc = 0;
    while oc + 8 <= o {
        let rows: [&[T]; 8] = std::array::from_fn(|i| &gn[(oc + i) * p + c0..][..tp]);
        for (t, d) in gt.chunks_exact_mut(o).enumerate() {
            let d = &mut d[oc..oc + 8];
            for i in 0..8 {
                d[i] = rows[i][t];
            }
        }
        oc += 8;
    }
    for oc in oc..o {
        for (d, &v) in gt.chunks_exact_mut(o).zip(&gn[oc * p + c0..][..tp]) {
            d[oc] = v;
        }
    }
}

/// Forward: `out[n, group rows] (= bias +) W_group @ im2col(x[n])`.
fn forward_kernel<T: Float>(g: &ConvGeom, x: &[T], w: &[T], bias: Option<&[T]>, out: &mut [T], ws: Option<&mut [T]>) {
    let (chw, p, col_len) = (g.c * g.hw(), g.p(), g.col_len());
    let (og, kg) = (g.og(), g.kg());
    let outp = SendPtr(out.as_mut_ptr());
    let wsp = SendPtr(ws.map_or(std::ptr::null_mut(), |s| s.as_mut_ptr()));
    run_lanes(g.lanes, |lane, threads| {
        let (outp, wsp) = (outp, wsp);
        let col: &mut [T] = if col_len == 0 {
            &mut []
        } else {
            // SAFETY: the workspace holds `lanes * col_len` elements; lane `lane` alone uses its slice.
            unsafe { std::slice::from_raw_parts_mut(wsp.0.add(lane * col_len), col_len) }
        };
        for n in g.samples(lane) {
            let xn = &x[n * chw..(n + 1) * chw];
            // SAFETY: sample n's output block lies inside `out` and is written by this lane only.
            let on = unsafe { std::slice::from_raw_parts_mut(outp.0.add(n * g.o * p), g.o * p) };
            for (r0, r1) in g.tiles() {
                let tp = (r1 - r0) * g.ow;
                let (src, src_rs) = tile_source(g, xn, r0, r1, col, threads);
                for gi in 0..g.groups {
                    if let Some(b) = bias {
                        for oc in gi * og..(gi + 1) * og {
                            on[oc * p + r0 * g.ow..][..tp].fill(b[oc]);
                        }
                    }
                    // SAFETY: dst is the [og, tp] block (row stride p) of this sample's output; the
                    // operands are the group's weight rows [og, kg] and im2col rows [kg, tp], all in
                    // bounds; dst does not alias them.
                    unsafe {
                        gemm_into::<T>(
                            og,
                            tp,
                            kg,
                            on.as_mut_ptr().add(gi * og * p + r0 * g.ow),
                            p as isize,
                            bias.is_some(),
                            Mat { ptr: w.as_ptr().add(gi * og * kg), rs: kg as isize, cs: 1 },
                            Mat { ptr: src.add(gi * kg * src_rs), rs: src_rs as isize, cs: 1 },
                            threads,
                            g.products,
                        )
                    };
                }
            }
        }
    });
}

/// Backward for the input and/or the weight (Note [conv2d work plan]).
#[allow(clippy::too_many_arguments)]
fn backward_kernel<T: Float>(
    g: &ConvGeom,
    x: &[T],
    w: &[T],
    gout: &[T],
    dx: Option<&mut [T]>,
    dw: Option<&mut [T]>,
    partials: Option<&mut [T]>,
    ws: Option<&mut [T]>,
) {
    let (chw, p, col_len, wlen) = (g.c * g.hw(), g.p(), g.col_len(), g.weight_len());
    let (og, kg, cg) = (g.og(), g.kg(), g.cg());
    let gt_len = if dw.is_some() { g.gt_len() } else { 0 };
    let lane_len = col_len + gt_len;
    let dxp = dx.map(|d| SendPtr(d.as_mut_ptr()));
    let pp = match (&dw, partials) {
        (Some(_), Some(parts)) => Some(SendPtr(parts.as_mut_ptr())),
        _ => None,
    };
    let wsp = SendPtr(ws.map_or(std::ptr::null_mut(), |s| s.as_mut_ptr()));
    run_lanes(g.lanes, |lane, threads| {
        let (dxp, pp, wsp) = (dxp, pp, wsp);
        let lane_ws: &mut [T] = if lane_len == 0 {
            &mut []
        } else {
            // SAFETY: the workspace holds `lanes * lane_len` elements; lane `lane` alone uses its slice.
            unsafe { std::slice::from_raw_parts_mut(wsp.0.add(lane * lane_len), lane_len) }
        };
        let (col, gt) = lane_ws.split_at_mut(col_len);
        // This lane's transposed weight-gradient accumulator: per group a [kg, og] block.
        // SAFETY: the partials workspace holds `lanes * wlen` elements when the weight gradient is needed.
        let part = pp.map(|pp| unsafe { pp.0.add(lane * wlen) });
        let mut first = true;
        for n in g.samples(lane) {
            let xn = &x[n * chw..(n + 1) * chw];
            let gn = &gout[n * g.o * p..(n + 1) * g.o * p];
            // SAFETY: sample n's input-gradient block lies inside dx and is written by this lane only.
            let mut dxn = dxp.map(|d| unsafe { std::slice::from_raw_parts_mut(d.0.add(n * chw), chw) });
            if !g.direct {
                if let Some(d) = dxn.as_deref_mut() {
                    d.fill(T::zero());
                }
            }
            for (r0, r1) in g.tiles() {
                let tp = (r1 - r0) * g.ow;
                if let Some(part) = part {
                    let (src, src_rs) = tile_source(g, xn, r0, r1, col, threads);
                    // gout^T as a contiguous [tp, O] operand: GEMM packs it much faster than the strided view.
                    transpose_tile(gn, g.o, p, r0 * g.ow, tp, gt);
                    for gi in 0..g.groups {
                        // dW_g^T [kg, og] (+)= col_g [kg, tp] @ gout_g^T [tp, og] (the transposed product
                        // runs faster than dW_g = gout_g @ col_g^T for conv shapes).
                        // SAFETY: `part` holds this lane's accumulator; operands are in bounds and do
                        // not alias it.
                        unsafe {
                            gemm_into::<T>(
                                kg,
                                og,
                                tp,
                                part.add(gi * kg * og),
                                og as isize,
                                !first,
                                Mat { ptr: src.add(gi * kg * src_rs), rs: src_rs as isize, cs: 1 },
                                Mat { ptr: gt.as_ptr().add(gi * og), rs: g.o as isize, cs: 1 },
                                threads,
                                g.products,
                            )
                        };
                    }
                    first = false;
                }
                if let Some(dxn) = dxn.as_deref_mut() {
                    for gi in 0..g.groups {
                        // col_g [kg, tp] = W_g^T [kg, og] @ gout_g [og, tp]; direct: straight into dx.
                        let (dst, dst_rs) = if g.direct {
                            // SAFETY: in bounds of this sample's dx block.
                            (unsafe { dxn.as_mut_ptr().add(gi * cg * g.hw() + r0 * g.ow) }, g.hw())
                        } else {
                            // SAFETY: in bounds of this lane's tile.
                            (unsafe { col.as_mut_ptr().add(gi * kg * tp) }, tp)
                        };
                        // SAFETY: dst is a fresh [kg, tp] block; operands are in bounds and do not alias it.
                        unsafe {
                            gemm_into::<T>(
                                kg,
                                tp,
                                og,
                                dst,
                                dst_rs as isize,
                                false,
                                Mat { ptr: w.as_ptr().add(gi * og * kg), rs: 1, cs: kg as isize },
                                Mat { ptr: gn.as_ptr().add(gi * og * p + r0 * g.ow), rs: p as isize, cs: 1 },
                                threads,
                                g.products,
                            )
                        };
                    }
                    if !g.direct {
                        col2im(g, col, r0, r1, dxn, threads > 1);
                    }
                }
            }
        }
    });
    if let Some(dw) = dw {
        sum_partials(g, pp, dw);
    }
}

/// The chunks of `batch` samples (the last may have fewer) of one lane's samples.
fn sample_chunks(g: &ConvGeom, lane: usize) -> impl Iterator<Item = Range<usize>> {
    let samples = g.samples(lane);
    let step = g.batch.max(1);
    (samples.start..samples.end).step_by(step).map(move |n0| n0..(n0 + step).min(samples.end))
}

/// Forward with whole samples side by side in a tile (Note [Batched columns] in `ops/conv.rs`): per
/// chunk of samples, one im2col tile `[kc, b*P]`, one product per group into the lane's output tile
/// `[O, b*P]`, then each sample's columns (and the bias) into its output.
fn forward_batched<T: Float>(g: &ConvGeom, x: &[T], w: &[T], bias: Option<&[T]>, out: &mut [T], ws: Option<&mut [T]>) {
    let (chw, p, col_len, out_len) = (g.c * g.hw(), g.p(), g.col_len(), g.out_len());
    let (og, kg, cols) = (g.og(), g.kg(), g.tile_cols());
    let lane_len = col_len + out_len;
    let outp = SendPtr(out.as_mut_ptr());
    let wsp = SendPtr(ws.map_or(std::ptr::null_mut(), |s| s.as_mut_ptr()));
    run_lanes(g.lanes, |lane, threads| {
        let (outp, wsp) = (outp, wsp);
        // SAFETY: the workspace holds `lanes * lane_len` elements; lane `lane` alone uses its slice.
        let lane_ws = unsafe { std::slice::from_raw_parts_mut(wsp.0.add(lane * lane_len), lane_len) };
        let (col, tile) = lane_ws.split_at_mut(col_len);
        for chunk in sample_chunks(g, lane) {
            let b = chunk.len();
            for (s, n) in chunk.clone().enumerate() {
                im2col_into(g, &x[n * chw..(n + 1) * chw], 0, g.oh, col, cols, s * p, threads > 1);
            }
            for gi in 0..g.groups {
                // SAFETY: the tile's [og, b*P] block (row stride `cols`) of group gi; the operands are
                // the group's weight rows and im2col rows, in bounds, not aliasing it.
                unsafe {
                    gemm_into::<T>(
                        og,
                        b * p,
                        kg,
                        tile.as_mut_ptr().add(gi * og * cols),
                        cols as isize,
                        false,
                        Mat { ptr: w.as_ptr().add(gi * og * kg), rs: kg as isize, cs: 1 },
                        Mat { ptr: col.as_ptr().add(gi * kg * cols), rs: cols as isize, cs: 1 },
                        threads,
                        g.products,
                    )
                };
            }
            for (s, n) in chunk.enumerate() {
                // SAFETY: sample n's output block lies inside `out` and is written by this lane only.
                let on = unsafe { std::slice::from_raw_parts_mut(outp.0.add(n * g.o * p), g.o * p) };
                for (oc, dst) in on.chunks_exact_mut(p.max(1)).enumerate().take(g.o) {
                    let src = &tile[oc * cols + s * p..][..p];
                    match bias {
                        // The bias first, then the product, as the unbatched kernel adds them.
                        Some(bias) => dst.iter_mut().zip(src).for_each(|(d, &v)| *d = bias[oc] + v),
                        None => dst.copy_from_slice(src),
                    }
                }
            }
        }
    });
}

/// Backward with whole samples side by side in a tile (Note [Batched columns]): per chunk, the
/// output gradient transposed into the lane's `[b*P, O]` tile serves both products: the weight
/// gradient's partial `[kg, og] += col [kg, b*P] @ gt [b*P, og]` and the input gradient's im2col
/// tile `col [kg, b*P] = W^T [kg, og] @ gt^T [og, b*P]`, whose columns go back to each sample.
#[allow(clippy::too_many_arguments)]
fn backward_batched<T: Float>(
    g: &ConvGeom,
    x: &[T],
    w: &[T],
    gout: &[T],
    dx: Option<&mut [T]>,
    dw: Option<&mut [T]>,
    partials: Option<&mut [T]>,
    ws: Option<&mut [T]>,
) {
    let (chw, p, col_len, wlen) = (g.c * g.hw(), g.p(), g.col_len(), g.weight_len());
    let (og, kg, cols) = (g.og(), g.kg(), g.tile_cols());
    let lane_len = col_len + g.gt_len();
    let dxp = dx.map(|d| SendPtr(d.as_mut_ptr()));
    let pp = match (&dw, partials) {
        (Some(_), Some(parts)) => Some(SendPtr(parts.as_mut_ptr())),
        _ => None,
    };
    let wsp = SendPtr(ws.map_or(std::ptr::null_mut(), |s| s.as_mut_ptr()));
    run_lanes(g.lanes, |lane, threads| {
        let (dxp, pp, wsp) = (dxp, pp, wsp);
        // SAFETY: the workspace holds `lanes * lane_len` elements; lane `lane` alone uses its slice.
        let lane_ws = unsafe { std::slice::from_raw_parts_mut(wsp.0.add(lane * lane_len), lane_len) };
        let (col, gt) = lane_ws.split_at_mut(col_len);
        // SAFETY: the partials workspace holds `lanes * wlen` elements when the weight gradient is needed.
        let part = pp.map(|pp| unsafe { pp.0.add(lane * wlen) });
        let mut first = true;
        for chunk in sample_chunks(g, lane) {
            let b = chunk.len();
            for (s, n) in chunk.clone().enumerate() {
                let gn = &gout[n * g.o * p..(n + 1) * g.o * p];
                transpose_tile(gn, g.o, p, 0, p, &mut gt[s * p * g.o..]);
            }
            if let Some(part) = part {
                for (s, n) in chunk.clone().enumerate() {
                    im2col_into(g, &x[n * chw..(n + 1) * chw], 0, g.oh, col, cols, s * p, threads > 1);
                }
                for gi in 0..g.groups {
                    // SAFETY: `part` holds this lane's accumulator; operands are in bounds and do not
                    // alias it.
                    unsafe {
                        gemm_into::<T>(
                            kg,
                            og,
                            b * p,
                            part.add(gi * kg * og),
                            og as isize,
                            !first,
                            Mat { ptr: col.as_ptr().add(gi * kg * cols), rs: cols as isize, cs: 1 },
                            Mat { ptr: gt.as_ptr().add(gi * og), rs: g.o as isize, cs: 1 },
                            threads,
                            g.products,
                        )
                    };
                }
                first = false;
            }
            if let Some(dxp) = dxp {
                for gi in 0..g.groups {
                    // SAFETY: the tile's [kg, b*P] block of group gi; operands in bounds, not aliasing it.
                    unsafe {
                        gemm_into::<T>(
                            kg,
                            b * p,
                            og,
                            col.as_mut_ptr().add(gi * kg * cols),
                            cols as isize,
                            false,
                            Mat { ptr: w.as_ptr().add(gi * og * kg), rs: 1, cs: kg as isize },
                            Mat { ptr: gt.as_ptr().add(gi * og), rs: 1, cs: g.o as isize },
                            threads,
                            g.products,
                        )
                    };
                }
                for (s, n) in chunk.enumerate() {
                    // SAFETY: sample n's input-gradient block lies inside dx and is written by this lane only.
                    let dxn = unsafe { std::slice::from_raw_parts_mut(dxp.0.add(n * chw), chw) };
                    dxn.fill(T::zero());
                    col2im_from(g, col, 0, g.oh, dxn, cols, s * p, threads > 1);
                }
            }
        }
    });
    if let Some(dw) = dw {
        sum_partials(g, pp, dw);
    }
}

/// The weight gradient: the lanes' transposed partials added in lane order (zero without lanes).
fn sum_partials<T: Float>(g: &ConvGeom, pp: Option<SendPtr<T>>, dw: &mut [T]) {
    let (og, kg, wlen) = (g.og(), g.kg(), g.weight_len());
    match pp {
        Some(pp) if g.lanes > 0 => {
            // SAFETY: the partials workspace holds lanes * wlen elements, no longer written.
            let parts = unsafe { std::slice::from_raw_parts(pp.0 as *const T, g.lanes * wlen) };
            // dW[gi*og + oo, kk] = sum over lanes (in lane order) of part[gi][kk, oo].
            let row = |(oc, d): (usize, &mut [T])| {
                let (gi, oo) = (oc / og.max(1), oc % og.max(1));
                d.fill(T::zero());
                for part in parts.chunks_exact(wlen) {
                    let block = &part[gi * kg * og..(gi + 1) * kg * og];
                    for (kk, v) in d.iter_mut().enumerate() {
                        *v += block[kk * og + oo];
                    }
                }
            };
            if kg > 0 {
                if wlen * g.lanes >= 1 << 15 {
                    dw.par_chunks_mut(kg).enumerate().for_each(row);
                } else {
                    dw.chunks_mut(kg).enumerate().for_each(row);
                }
            }
        }
        _ => dw.fill(T::zero()),
    }
}

/// Sum of a slice with eight independent accumulators (a serial sum is latency-bound).
fn fast_sum<T: Float>(v: &[T]) -> T {
    let mut acc = [T::zero(); 8];
    let mut chunks = v.chunks_exact(8);
    for c in &mut chunks {
        for i in 0..8 {
            acc[i] += c[i];
        }
    }
    let tail: T = chunks.remainder().iter().copied().sum();
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

/// `db[o] = sum over n, oh, ow of gout[n, o, oh, ow]`.
fn bias_grad<T: Float>(g: &ConvGeom, gout: &[T], db: &mut [T]) {
    let p = g.p();
    let sum = |(oc, d): (usize, &mut T)| {
        let mut s = T::zero();
        for n in 0..g.n {
            s += fast_sum(&gout[(n * g.o + oc) * p..][..p]);
        }
        *d = s;
    };
    if g.n * g.o * p >= 1 << 16 {
        db.par_iter_mut().enumerate().for_each(sum);
    } else {
        db.iter_mut().enumerate().for_each(sum);
    }
}
