//! CPU kernels of 2-D convolution (`ops/conv.rs`): im2col / col2im, the per-lane GEMM loops of the
//! forward and of the input and weight gradients, the lane-ordered sum of the weight partials and the
//! bias gradient. The work plan (lanes, tiles, workspace sizes) is the op's [`ConvGeom`]; these
//! kernels only follow it (Note [conv2d work plan] in `ops/conv.rs`).

use super::gemm::{gemm_into, Mat, Products, SendPtr};
use crate::dtype::Float;
use crate::error::{check_len, Result};
use crate::view::View;
use crate::with_float;
use memfit_kernels::{multiversion, Isa};
use rayon::prelude::*;
use std::ops::Range;

mod depthwise;

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
    /// Each output channel reads one input channel (groups = C > 1) and the products are f32's: the
    /// [`depthwise`] kernels compute it tap by tap, with no im2col, product or workspace.
    pub depthwise: bool,
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
        if self.direct || self.depthwise {
            0
        } else {
            self.kc() * self.tile_cols()
        }
    }
    /// Elements of one lane's transposed output-gradient tile `[columns, O]` (the weight gradient's;
    /// with batched samples the input gradient reads it too).
    pub fn gt_len(&self) -> usize {
        if self.depthwise {
            0
        } else {
            self.o * self.tile_cols()
        }
    }
    /// Elements of one lane's output tile `[O, columns]` (batched samples only: their outputs are
    /// scattered from it).
    pub fn out_len(&self) -> usize {
        if self.batch > 1 && !self.depthwise {
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
        let (x, w) = operands::<T>(g, x, weight)?;
        if let Some(b) = b {
            check_len("conv2d bias", b.len(), g.o)?;
        }
        if g.depthwise {
            depthwise::forward::<T>(g, x, w, b, out);
            return Ok(());
        }
        let lane_len = g.col_len() + g.out_len();
        check_len("conv2d im2col workspace", ws.as_ref().map_or(0, |s| s.len()), g.lanes * lane_len)?;
        match g.batch > 1 {
            true => forward_batched::<T>(g, x, w, b, out, ws),
            false => forward_kernel::<T>(g, x, w, b, out, ws),
        }
    });
    Ok(())
}

/// The gradients of conv2d that are asked for (`dx`, `dw`, `db`), from the output gradient `grad`
/// (contiguous), with the op's workspaces: per lane an im2col tile (and, for `dw`, a transposed
/// output-gradient tile), and the per-lane weight-gradient partials (for `dw`); a depthwise plan
/// (`g.depthwise`) has none of them.
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
        check_len("conv2d output gradient", gout.len(), g.n * g.o * g.p())?;
        if dx.is_some() || dw.is_some() {
            let (x, w) = operands::<T>(g, x, weight)?;
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
            if dws.is_some() {
                check_len("conv2d weight gradient", len(&dws), g.weight_len())?;
            }
            if g.depthwise {
                depthwise::backward::<T>(g, x, w, gout, dxs, dws);
            } else {
                let gt_len = if dws.is_some() || g.batch > 1 { g.gt_len() } else { 0 };
                check_len("conv2d im2col workspace", len(&wss), g.lanes * (g.col_len() + gt_len))?;
                if dws.is_some() {
                    check_len("conv2d weight-gradient partials", len(&ps), g.lanes * g.weight_len())?;
                }
                match g.batch > 1 {
                    true => backward_batched::<T>(g, x, w, gout, dxs, dws, ps, wss),
                    false => backward_kernel::<T>(g, x, w, gout, dxs, dws, ps, wss),
                }
            }
        }
        if let Some(db) = db {
            bias_grad::<T>(g, gout, db.slice_mut::<T>()?);
        }
    });
    Ok(())
}

/// The input and the weight as slices, each checked against the plan's length (the kernels index
/// them, and the GEMM reads the weight through a pointer).
fn operands<'a, T: Float + crate::dtype::Element>(
    g: &ConvGeom,
    x: View<'a>,
    weight: View<'a>,
) -> Result<(&'a [T], &'a [T])> {
    let (x, w) = (x.slice::<T>()?, weight.slice::<T>()?);
    check_len("conv2d input", x.len(), g.n * g.c * g.hw())?;
    check_len("conv2d weight", w.len(), g.weight_len())?;
    Ok((x, w))
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
    im2col_samples(g, xn, 1, r0, r1, col, (r1 - r0) * g.ow, parallel);
}

/// `dst[lo..hi]` from `src` every `step` values, the rest of `dst` zero: one row of one sample in an
/// im2col tile. One select per value: the rows of small planes are a few values long, and a loop
/// that only zeroes or copies becomes a call to the C library's `memset`/`memcpy`, which costs more
/// than such a row.
#[inline(always)]
fn gather_row<T: Float>(dst: &mut [T], lo: usize, hi: usize, src: &[T], step: usize) {
    for (t, d) in dst.iter_mut().enumerate() {
        *d = if t >= lo && t < hi { src[(t - lo) * step] } else { T::zero() };
    }
}

/// Zeroes `dst`; a short row without a call to `memset` (see [`gather_row`]): the opaque zero
/// keeps the loop from being turned into one.
#[inline(always)]
fn zero_row<T: Float>(dst: &mut [T]) {
    if dst.len() >= 64 {
        dst.fill(T::zero());
    } else {
        dst.iter_mut().for_each(|d| *d = std::hint::black_box(T::zero()));
    }
}

/// The im2col tiles of `samples` consecutive samples (`x` starts at the first) for output rows
/// `r0..r1`, side by side in a tile whose rows are `rs` long: sample `s`'s columns start at
/// `s * (r1 - r0) * OW` (Note [Batched columns] in `ops/conv.rs`). One task per input channel, each
/// walking every sample, so a batch of small planes costs one parallel dispatch, not one a sample.
#[allow(clippy::too_many_arguments)]
fn im2col_samples<T: Float>(
    g: &ConvGeom,
    x: &[T],
    samples: usize,
    r0: usize,
    r1: usize,
    col: &mut [T],
    rs: usize,
    parallel: bool,
) {
    let (isa, per_channel) = (Isa::active(), g.kh * g.kw * rs);
    let channel = |(ci, dst): (usize, &mut [T])| im2col_channel(isa, g, x, samples, r0..r1, rs, ci, dst);
    let col = &mut col[..g.c * per_channel];
    if parallel {
        col.par_chunks_mut(per_channel).enumerate().for_each(channel);
    } else {
        col.chunks_mut(per_channel).enumerate().for_each(channel);
    }
}

multiversion! {
    /// [`im2col_samples`]' rows of input channel `ci` (`dst`: its `kh * kw` rows, `rs` apart).
    fn im2col_channel<T: Float>(g: &ConvGeom, x: &[T], samples: usize, rows: Range<usize>, rs: usize, ci: usize, dst: &mut [T]) {
        let (r0, r1) = (rows.start, rows.end);
        let (ow, tp, hw, chw) = (g.ow, (r1 - r0) * g.ow, g.hw(), g.c * g.hw());
        // Stride 1 both ways, no width dilation and the output as wide as the input ("same"
        // padding): a tap's rows of a sample are one shifted run of the input plane (see
        // `shifted_plane`).
        let shifted = g.sh == 1 && g.sw == 1 && g.dw == 1 && ow == g.w;
        for ki in 0..g.kh {
            for kj in 0..g.kw {
                let row = &mut dst[(ki * g.kw + kj) * rs..][..samples * tp];
                if shifted {
                    let offsets = ((ki * g.dh) as isize - g.ph as isize, kj as isize - g.pw as isize);
                    for (s, seg) in row.chunks_exact_mut(tp).enumerate() {
                        shifted_plane(seg, &x[s * chw + ci * hw..][..hw], g.h, g.w, r0..r1, offsets);
                    }
                    continue;
                }
                let (lo, hi) = valid_range(kj * g.dw, g.pw, g.sw, g.w, ow);
                let inside = |orow: usize| {
                    let ih = orow * g.sh + ki * g.dh;
                    ih >= g.ph && ih - g.ph < g.h && lo < hi
                };
                if !(r0..r1).any(inside) {
                    // The tap reads only padding (most of a 3x3 kernel's over a 1x1 plane): one fill.
                    row.fill(T::zero());
                    continue;
                }
                // Input column of output column `lo` (>= 0 by construction of `lo`).
                let s0 = lo * g.sw + kj * g.dw - g.pw;
                for (t, orow) in (r0..r1).enumerate() {
                    let ih = orow * g.sh + ki * g.dh;
                    let inside = inside(orow);
                    for s in 0..samples {
                        let seg = &mut row[s * tp + t * ow..][..ow];
                        if inside {
                            let src = &x[s * chw + ci * hw + (ih - g.ph) * g.w + s0..];
                            gather_row(seg, lo, hi, src, g.sw);
                        } else {
                            zero_row(seg);
                        }
                    }
                }
            }
        }
    }
}

/// One tap's im2col rows `rows` of one sample when the convolution has stride 1 both ways, no
/// width dilation and an output as wide as the input: `dst[(o - rows.start) * w + u]` =
/// `plane[(o + dr) * w + u + dc]`, 0 where that falls outside the `h x w` plane. The rows inside
/// are one contiguous run of the plane shifted by `dr * w + dc` (a single copy), whose values that
/// wrapped around from a neighbouring row (`u + dc` outside `0..w`) are then zeroed, at most
/// `|dc|` a row: a few operations a row instead of a few a value.
#[inline(always)]
fn shifted_plane<T: Float>(
    dst: &mut [T],
    plane: &[T],
    h: usize,
    w: usize,
    rows: Range<usize>,
    (dr, dc): (isize, isize),
) {
    // Output rows whose input row o + dr lies in 0..h.
    let a = (rows.start as isize).max(-dr).clamp(rows.start as isize, rows.end as isize) as usize;
    let b = (rows.end as isize).min(h as isize - dr).clamp(a as isize, rows.end as isize) as usize;
    let (head, rest) = dst.split_at_mut((a - rows.start) * w);
    let (body, tail) = rest.split_at_mut((b - a) * w);
    head.fill(T::zero());
    tail.fill(T::zero());
    if body.is_empty() {
        return;
    }
    // body[j] = plane[start + j], for the j whose source lies in the plane (the others wrapped).
    let start = (a as isize + dr) * w as isize + dc;
    let lo = (-start).clamp(0, body.len() as isize) as usize;
    let hi = (plane.len() as isize - start).clamp(lo as isize, body.len() as isize) as usize;
    if hi > lo {
        body[lo..hi].copy_from_slice(&plane[(start + lo as isize) as usize..][..hi - lo]);
    }
    // The columns u with u + dc outside 0..w, in every row (covering body[..lo] and body[hi..]).
    let wrapped = if dc < 0 { 0..(-dc as usize).min(w) } else { w - (dc as usize).min(w)..w };
    if !wrapped.is_empty() {
        for row in body.chunks_exact_mut(w) {
            zero_row(&mut row[wrapped.clone()]);
        }
    }
}

/// Adds an im2col-shaped tile (output rows `r0..r1`) back onto the input positions it was read from.
fn col2im<T: Float>(g: &ConvGeom, col: &[T], r0: usize, r1: usize, dxn: &mut [T], parallel: bool) {
    let tp = (r1 - r0) * g.ow;
    // SAFETY: `dxn` holds one sample's input gradient, C planes, and nothing else uses it meanwhile.
    unsafe { col2im_samples(g, col, 1, r0, r1, SendPtr(dxn[..g.c * g.hw()].as_mut_ptr()), tp, false, parallel) };
}

/// The inverse of [`im2col_samples`]: adds the tile of `samples` consecutive samples (rows `rs`
/// long) onto their input gradients at `dx` (the first sample's; set to zero first when `zero`).
/// One task per input channel, each writing that channel's plane of every sample.
///
/// # Safety
/// `dx` holds `samples` input gradients of C planes each, which nothing else uses meanwhile.
#[allow(clippy::too_many_arguments)]
unsafe fn col2im_samples<T: Float>(
    g: &ConvGeom,
    col: &[T],
    samples: usize,
    r0: usize,
    r1: usize,
    dx: SendPtr<T>,
    rs: usize,
    zero: bool,
    parallel: bool,
) {
    if g.hw() == 0 {
        return;
    }
    let (isa, per_channel) = (Isa::active(), g.kh * g.kw * rs);
    // Each task takes its own channel, so writes its planes alone (`col2im_channel`'s contract).
    let channel = |(ci, src): (usize, &[T])| col2im_channel(isa, g, src, samples, r0..r1, rs, ci, dx, zero);
    let col = &col[..g.c * per_channel];
    if parallel {
        col.par_chunks(per_channel).enumerate().for_each(channel);
    } else {
        col.chunks(per_channel).enumerate().for_each(channel);
    }
}

multiversion! {
    /// [`col2im_samples`]' work for input channel `ci` (`src`: its `kh * kw` rows, `rs` apart).
    /// Contract (a safe function only because `multiversion!` makes safe ones; private to this
    /// file): channel ci's plane of each of the `samples` input gradients at `dx` is this call's
    /// alone, as `col2im_samples` promises its caller's `dx` and gives each task its own channel.
    fn col2im_channel<T: Float>(g: &ConvGeom, src: &[T], samples: usize, rows: Range<usize>, rs: usize, ci: usize, dx: SendPtr<T>, zero: bool) {
        let (r0, r1) = (rows.start, rows.end);
        let (ow, tp, hw, chw) = (g.ow, (r1 - r0) * g.ow, g.hw(), g.c * g.hw());
        // SAFETY: channel ci's plane of sample s, this call's alone (the contract above).
        let plane = |s: usize| unsafe { dx.slice_mut(s * chw + ci * hw, hw) };
        if zero {
            (0..samples).for_each(|s| zero_row(plane(s)));
        }
        for ki in 0..g.kh {
            for kj in 0..g.kw {
                let row = &src[(ki * g.kw + kj) * rs..][..samples * tp];
                let (lo, hi) = valid_range(kj * g.dw, g.pw, g.sw, g.w, ow);
                if lo == hi {
                    continue;
                }
                let s0 = lo * g.sw + kj * g.dw - g.pw;
                for (t, orow) in (r0..r1).enumerate() {
                    let ih = orow * g.sh + ki * g.dh;
                    if ih < g.ph || ih - g.ph >= g.h {
                        continue;
                    }
                    for s in 0..samples {
                        let seg = &row[s * tp + t * ow..][lo..hi];
                        let dst = &mut plane(s)[(ih - g.ph) * g.w + s0..];
                        if g.sw == 1 {
                            dst.iter_mut().zip(seg).for_each(|(d, &v)| *d += v);
                        } else {
                            dst.iter_mut().step_by(g.sw).zip(seg).for_each(|(d, &v)| *d += v);
                        }
                    }
                }
            }
        }
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
            im2col_samples(g, &x[chunk.start * chw..chunk.end * chw], b, 0, g.oh, col, cols, threads > 1);
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
                im2col_samples(g, &x[chunk.start * chw..chunk.end * chw], b, 0, g.oh, col, cols, threads > 1);
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
                // SAFETY: the chunk's input-gradient blocks lie inside dx and are written by this lane only.
                unsafe {
                    let dx = SendPtr(dxp.0.add(chunk.start * chw));
                    col2im_samples(g, col, b, 0, g.oh, dx, cols, true, threads > 1);
                }
            }
        }
    });
    if let Some(dw) = dw {
        sum_partials(g, pp, dw);
    }
}

/// Rows of the weight gradient [`sum_partials`] writes in one block.
const SUM_ROWS: usize = 16;

/// The weight gradient: the lanes' transposed partials added in lane order (zero without lanes).
/// A block of [`SUM_ROWS`] output channels at a time, so that each step reads that many adjacent
/// values of a partial's row (one value per row, the partials' columns, touched a cache line per
/// value: for resnet18's 512-channel 3x3 kernels that made the sum cost more than the product).
fn sum_partials<T: Float>(g: &ConvGeom, pp: Option<SendPtr<T>>, dw: &mut [T]) {
    let (og, kg, wlen) = (g.og(), g.kg(), g.weight_len());
    match pp {
        Some(pp) if g.lanes > 0 && kg > 0 && og > 0 => {
            // SAFETY: the partials workspace holds lanes * wlen elements, no longer written.
            let parts = unsafe { std::slice::from_raw_parts(pp.0 as *const T, g.lanes * wlen) };
            // dW[gi*og + oo, kk] = sum over lanes (in lane order) of part[gi][kk, oo], from zero.
            let block = |(bi, d): (usize, &mut [T])| {
                let rows = d.len() / kg;
                // Where row r's column starts in a partial.
                let column: [usize; SUM_ROWS] = std::array::from_fn(|r| {
                    let oc = bi * SUM_ROWS + r;
                    (oc / og) * kg * og + oc % og
                });
                d.fill(T::zero());
                for part in parts.chunks_exact(wlen) {
                    // Squares of SUM_ROWS x SUM_ROWS: the rows' values are read from the same
                    // cache lines and written contiguously.
                    for k0 in (0..kg).step_by(SUM_ROWS) {
                        let k1 = (k0 + SUM_ROWS).min(kg);
                        for (r, &at) in column[..rows].iter().enumerate() {
                            for (kk, v) in d[r * kg + k0..r * kg + k1].iter_mut().enumerate() {
                                *v += part[at + (k0 + kk) * og];
                            }
                        }
                    }
                }
            };
            if wlen * g.lanes >= 1 << 15 {
                dw.par_chunks_mut(SUM_ROWS * kg).enumerate().for_each(block);
            } else {
                dw.chunks_mut(SUM_ROWS * kg).enumerate().for_each(block);
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A convolution of `n` samples of `c` x `h` x `w` by `o` kernels of `k` x `k` (groups = C when
    /// `depthwise`), stride `s`, padding `p`, dilation `d`, tiles of whole samples.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn geom(
        n: usize,
        c: usize,
        hw: usize,
        o: usize,
        k: usize,
        s: usize,
        p: usize,
        d: usize,
        depthwise: bool,
    ) -> ConvGeom {
        let out = (hw + 2 * p - d * (k - 1) - 1) / s + 1;
        ConvGeom {
            n,
            c,
            h: hw,
            w: hw,
            o,
            kh: k,
            kw: k,
            oh: out,
            ow: out,
            sh: s,
            sw: s,
            ph: p,
            pw: p,
            dh: d,
            dw: d,
            groups: if depthwise { c } else { 1 },
            direct: false,
            depthwise,
            tile_rows: out,
            lanes: 1,
            per_lane: n,
            batch: n,
            products: Products::F32,
        }
    }

    /// Geometries with stride 1 and "same" width (im2col's shifted runs), stride 2, dilation 2,
    /// and a kernel wider than the plane.
    pub(super) fn geometries(depthwise: bool) -> Vec<ConvGeom> {
        let o = |c: usize| if depthwise { 2 * c } else { 5 };
        vec![
            geom(3, 4, 7, o(4), 3, 1, 1, 1, depthwise),
            geom(3, 4, 9, o(4), 3, 2, 1, 1, depthwise),
            geom(2, 3, 11, o(3), 3, 1, 2, 2, depthwise),
            geom(2, 3, 2, o(3), 5, 1, 2, 1, depthwise),
            geom(2, 2, 20, o(2), 5, 1, 2, 1, depthwise),
        ]
    }

    /// im2col's and col2im's per-channel work gives the portable copy's bits on every level.
    #[test]
    fn im2col_and_col2im_give_the_same_bits_on_every_level() {
        for g in geometries(false) {
            let x: Vec<f32> = crate::test_values::uniform(g.n * g.c * g.hw(), 5).map(|v| v as f32).collect();
            let rs = g.n * g.p();
            let per_channel = g.kh * g.kw * rs;
            let col: Vec<f32> = crate::test_values::uniform(g.c * per_channel, 6).map(|v| v as f32).collect();
            let run = |isa: Isa| {
                let mut tile = vec![0f32; g.c * per_channel];
                let mut dx = vec![1f32; g.n * g.c * g.hw()];
                for ci in 0..g.c {
                    im2col_channel(isa, &g, &x, g.n, 0..g.oh, rs, ci, &mut tile[ci * per_channel..][..per_channel]);
                    let dxp = SendPtr(dx.as_mut_ptr());
                    col2im_channel(isa, &g, &col[ci * per_channel..][..per_channel], g.n, 0..g.oh, rs, ci, dxp, true);
                }
                [tile, dx].map(|v| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>())
            };
            let want = run(Isa::Portable);
            for isa in Isa::supported() {
                assert_eq!(run(isa), want, "{isa} vs portable: {g:?}");
            }
        }
    }
}
