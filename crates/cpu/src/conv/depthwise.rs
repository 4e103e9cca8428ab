//! Depthwise convolutions (each output channel reads one input channel: `groups` = C, the
//! MobileNet / EfficientNet / ConvNeXt kind) computed tap by tap, without im2col, products or
//! workspace: through im2col each group is a product of one row (or a few) by a handful of columns,
//! and the copying and the per-product overhead cost many times the arithmetic.
//!
//! Note [Depthwise convolution]
//! With f32 products (a bf16 or fp16 product rounds its operands: those go through im2col and the
//! GEMM door, which defines that rounding), over the taps that read inside the input (a padded tap
//! adds nothing):
//! - forward: each output value starts from zero and adds `w * x` for its taps in kernel order
//!   (row by row), a multiplication and an addition each, then the bias is added;
//! - input gradient: each input value starts from zero and adds `w * g` for each of its output
//!   channels in order and, within one, for each tap in kernel order;
//! - weight gradient: each weight adds `g * x` over the samples in order and, within one, the output
//!   positions row by row, the k-th product of a row into partial sum `k % LANES`, the partial sums
//!   combined as `lane_sum` combines them; the bias gradient is the im2col path's.
//!
//! No fused multiply-add, so every instruction set gives the same bits (the loops vectorise along a
//! row), and the work is split by output, input or weight planes, so the thread count never
//! changes a bit.

use super::{valid_range, ConvGeom};
use crate::dtype::Float;
use crate::elementwise::{combine_lanes, LANES};
use memfit_kernels::{multiversion, Isa};
use rayon::prelude::*;

/// A run of one tap over one output row: outputs `out..out + len` of a plane read inputs `inp`,
/// `inp + sw`, ... of the input plane, all inside it.
#[derive(Clone, Copy)]
struct Segment {
    tap: usize,
    out: usize,
    inp: usize,
    len: usize,
}

/// Every tap's runs that read inside the input, in kernel order and, within a tap, row by row: the
/// same for every plane of the convolution, so found once a call instead of once a plane (a small
/// plane has more taps than values a row).
fn segments(g: &ConvGeom) -> Vec<Segment> {
    let mut all = Vec::new();
    for ki in 0..g.kh {
        for kj in 0..g.kw {
            let (lo, hi) = valid_range(kj * g.dw, g.pw, g.sw, g.w, g.ow);
            if lo == hi {
                continue;
            }
            let s0 = lo * g.sw + kj * g.dw - g.pw;
            for orow in 0..g.oh {
                let ih = orow * g.sh + ki * g.dh;
                if ih >= g.ph && ih - g.ph < g.h {
                    let (out, inp) = (orow * g.ow + lo, (ih - g.ph) * g.w + s0);
                    all.push(Segment { tap: ki * g.kw + kj, out, inp, len: hi - lo });
                }
            }
        }
    }
    all
}

multiversion! {
    /// One output plane: `out = bias + sum over taps of w * x` (Note [Depthwise convolution]).
    fn forward_plane<T: Float>(segs: &[Segment], sw: usize, xp: &[T], wk: &[T], bias: Option<T>, out: &mut [T]) {
        out.fill(T::zero());
        for s in segs {
            let (wv, dst) = (wk[s.tap], &mut out[s.out..s.out + s.len]);
            if sw == 1 {
                dst.iter_mut().zip(&xp[s.inp..s.inp + s.len]).for_each(|(d, &v)| *d += wv * v);
            } else {
                dst.iter_mut().enumerate().for_each(|(i, d)| *d += wv * xp[s.inp + i * sw]);
            }
        }
        if let Some(b) = bias {
            out.iter_mut().for_each(|d| *d = b + *d);
        }
    }
}

multiversion! {
    /// One input plane's gradient from the output planes `gp` of its channel (`p` values each) and
    /// their kernels `wk` (`kk` taps each) (Note [Depthwise convolution]).
    fn input_grad_plane<T: Float>(segs: &[Segment], sw: usize, p: usize, kk: usize, gp: &[T], wk: &[T], dx: &mut [T]) {
        dx.fill(T::zero());
        for (gp, wk) in gp.chunks_exact(p).zip(wk.chunks_exact(kk)) {
            for s in segs {
                let (wv, src) = (wk[s.tap], &gp[s.out..s.out + s.len]);
                if sw == 1 {
                    dx[s.inp..s.inp + s.len].iter_mut().zip(src).for_each(|(d, &v)| *d += wv * v);
                } else {
                    src.iter().enumerate().for_each(|(i, &v)| dx[s.inp + i * sw] += wv * v);
                }
            }
        }
    }
}

multiversion! {
    /// One output channel's kernel gradient `dw[tap]` from its output planes (every sample's, `o`
    /// planes apart in `gout`) and its input channel's planes in `x` (Note [Depthwise
    /// convolution]). `segs` in kernel order, so each tap's runs are adjacent.
    fn weight_grad_channel<T: Float>(g: &ConvGeom, segs: &[Segment], oc: usize, x: &[T], gout: &[T], dw: &mut [T]) {
        let (p, hw, ci, sw) = (g.p(), g.hw(), oc / g.og(), g.sw);
        dw.fill(T::zero());
        for tap_segs in segs.chunk_by(|a, b| a.tap == b.tap) {
            let mut acc = [T::zero(); LANES];
            for n in 0..g.n {
                let gp = &gout[(n * g.o + oc) * p..][..p];
                let xp = &x[(n * g.c + ci) * hw..][..hw];
                for s in tap_segs {
                    let gr = &gp[s.out..s.out + s.len];
                    if sw == 1 {
                        // Whole groups of LANES (vectorised), then the rest: the same lanes.
                        let xr = &xp[s.inp..s.inp + s.len];
                        let (ga, xa) = (gr.chunks_exact(LANES), xr.chunks_exact(LANES));
                        let (gt, xt) = (ga.remainder(), xa.remainder());
                        for (ga, xa) in ga.zip(xa) {
                            for l in 0..LANES {
                                acc[l] += ga[l] * xa[l];
                            }
                        }
                        for (l, (&a, &b)) in gt.iter().zip(xt).enumerate() {
                            acc[l] += a * b;
                        }
                    } else {
                        for (j, &a) in gr.iter().enumerate() {
                            acc[j % LANES] += a * xp[s.inp + j * sw];
                        }
                    }
                }
            }
            dw[tap_segs[0].tap] = combine_lanes(&acc, T::zero());
        }
    }
}

/// Planes of at least this many values go one to a parallel task; smaller ones are grouped.
const PLANE_GROUP: usize = 4096;

/// Calls `f(plane index, plane)` for every `len`-long plane of `data`, in parallel, grouping small
/// planes so that a task holds about [`PLANE_GROUP`] values.
fn for_planes<T: Float>(data: &mut [T], len: usize, f: impl Fn(usize, &mut [T]) + Sync + Send) {
    if len == 0 {
        return;
    }
    let per = (PLANE_GROUP / len).max(1);
    data.par_chunks_mut(per * len).enumerate().for_each(|(t, group)| {
        for (i, plane) in group.chunks_exact_mut(len).enumerate() {
            f(t * per + i, plane);
        }
    });
}

/// `out = conv2d(x, w) (+ bias)` of a depthwise convolution.
pub(super) fn forward<T: Float>(g: &ConvGeom, x: &[T], w: &[T], bias: Option<&[T]>, out: &mut [T]) {
    let (isa, og, kk, hw, segs) = (Isa::active(), g.og(), g.kh * g.kw, g.hw(), segments(g));
    for_planes(out, g.p(), |plane, dst| {
        let (n, oc) = (plane / g.o, plane % g.o);
        let xp = &x[(n * g.c + oc / og) * hw..][..hw];
        forward_plane(isa, &segs, g.sw, xp, &w[oc * kk..][..kk], bias.map(|b| b[oc]), dst);
    });
}

/// The gradients asked for of a depthwise convolution from the output gradient `gout`: the input's
/// `dx` and the weight's `dw` (written, not added to), the taps' runs found once for both.
pub(super) fn backward<T: Float>(
    g: &ConvGeom,
    x: &[T],
    w: &[T],
    gout: &[T],
    dx: Option<&mut [T]>,
    dw: Option<&mut [T]>,
) {
    let (isa, og, kk, p, segs) = (Isa::active(), g.og(), g.kh * g.kw, g.p(), segments(g));
    if let Some(dx) = dx {
        for_planes(dx, g.hw(), |plane, dst| {
            let (n, ci) = (plane / g.c, plane % g.c);
            let gp = &gout[(n * g.o + ci * og) * p..][..og * p];
            input_grad_plane(isa, &segs, g.sw, p, kk, gp, &w[ci * og * kk..][..og * kk], dst);
        });
    }
    if let Some(dw) = dw.filter(|_| kk > 0) {
        dw.par_chunks_mut(kk).enumerate().for_each(|(oc, d)| weight_grad_channel(isa, g, &segs, oc, x, gout, d));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::conv::tests::geometries;

    /// Every depthwise kernel gives the portable copy's bits on every level (and its plane loops
    /// the definition's order, so rows shorter and longer than a vector and strided ones too).
    #[test]
    fn every_level_gives_the_portable_bits() {
        for g in geometries(true) {
            let values = |len: usize, seed: u64| -> Vec<f32> {
                crate::test_values::uniform(len, seed).map(|v| v as f32).collect()
            };
            let (x, w, gout) = (values(g.n * g.c * g.hw(), 1), values(g.weight_len(), 2), values(g.n * g.o * g.p(), 3));
            let (segs, kk, og) = (segments(&g), g.kh * g.kw, g.og());
            let run = |isa: Isa| {
                let mut out = vec![0f32; g.p()];
                forward_plane(isa, &segs, g.sw, &x[..g.hw()], &w[og * kk..][..kk], Some(0.25), &mut out);
                let mut dx = vec![0f32; g.hw()];
                input_grad_plane(isa, &segs, g.sw, g.p(), kk, &gout[..og * g.p()], &w[..og * kk], &mut dx);
                let mut dw = vec![0f32; kk];
                weight_grad_channel(isa, &g, &segs, 1, &x, &gout, &mut dw);
                [out, dx, dw].map(|v| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>())
            };
            let want = run(Isa::Portable);
            for isa in Isa::supported() {
                assert_eq!(run(isa), want, "{isa} vs portable: {g:?}");
            }
        }
    }
}
