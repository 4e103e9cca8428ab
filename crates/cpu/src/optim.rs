//! CPU kernels of the fused optimizer updates and gradient unscaling (`ops/optim.rs`): one pass over
//! memory per update, following PyTorch's single-tensor CPU path rounding step by rounding step
//! (Note [Optimizer arithmetic] in `ops/optim.rs`). Large tensors are split into disjoint chunks
//! updated in parallel (elementwise, so the result does not depend on the thread count).

use crate::dtype::Float;
use crate::error::Result;
use crate::view::View;
use crate::with_float;
use crate::PAR_CHUNK;
use rayon::prelude::*;

/// One SGD step's hyper-parameters as the caller gives them (Python floats: f64); the kernel casts
/// them to the parameter's dtype (Note [Optimizer arithmetic]).
#[derive(Clone, Copy, Debug)]
pub struct SgdStep {
    pub lr: f64,
    pub momentum: f64,
    pub dampening: f64,
    pub nesterov: bool,
    pub weight_decay: f64,
    /// The momentum buffer is fresh: it is overwritten with the gradient, not blended.
    pub first_step: bool,
}

/// One Adam / AdamW step's hyper-parameters as the caller gives them (Python floats: f64); the
/// kernel derives the bias corrections in f64 and casts to the parameter's dtype
/// (Note [Optimizer arithmetic]).
#[derive(Clone, Copy, Debug)]
pub struct AdamStep {
    /// Numbered from 1.
    pub step: u64,
    pub lr: f64,
    pub betas: (f64, f64),
    pub eps: f64,
    pub weight_decay: f64,
    /// AdamW: decay the parameter, not the gradient.
    pub decoupled: bool,
}

/// SGD hyper-parameters already cast to the parameter's dtype (Note [Optimizer arithmetic]).
#[derive(Clone, Copy)]
struct Sgd<T> {
    weight_decay: Option<T>,
    momentum: T,
    one_minus_dampening: T,
    nesterov: bool,
    first_step: bool,
    neg_lr: T,
}

impl<T: Float> Sgd<T> {
    /// `grad.add(param, alpha=wd)`.
    #[inline(always)]
    fn decayed(&self, p: T, g: T) -> T {
        match self.weight_decay {
            Some(wd) => g + wd * p,
            None => g,
        }
    }

    /// Without momentum: `param.add_(g', alpha=-lr)`.
    #[inline(always)]
    fn plain(&self, p: &mut T, g: T) {
        let g = self.decayed(*p, g);
        *p += self.neg_lr * g;
    }

    /// With momentum: `buf = clone(g')` on the first step, else `buf.mul_(m).add_(g', alpha=1-d)`;
    /// the step direction is `g'.add(buf, alpha=m)` (Nesterov) or `buf`.
    #[inline(always)]
    fn with_momentum(&self, p: &mut T, g: T, buf: &mut T) {
        let g = self.decayed(*p, g);
        let b = if self.first_step { g } else { *buf * self.momentum + self.one_minus_dampening * g };
        *buf = b;
        let d = if self.nesterov { g + self.momentum * b } else { b };
        *p += self.neg_lr * d;
    }
}

/// One SGD step over `param` (and `momentum_buffer` when given), all contiguous, same dtype.
pub fn sgd_update(param: View<'_>, grad: View<'_>, buf: Option<View<'_>>, step: SgdStep) -> Result<()> {
    let SgdStep { lr, momentum, dampening, nesterov, weight_decay, first_step } = step;
    with_float!(param.dtype(), "sgd_update", T => {
        let k = Sgd::<T> {
            weight_decay: (weight_decay != 0.0).then(|| T::of(weight_decay)),
            momentum: T::of(momentum),
            one_minus_dampening: T::of(1.0 - dampening),
            nesterov,
            first_step,
            neg_lr: T::of(-lr),
        };
        let p = param.slice_mut::<T>()?;
        let g = grad.slice::<T>()?;
        let parallel = p.len() >= 2 * PAR_CHUNK;
        match buf {
            None => {
                let run = |p: &mut [T], g: &[T]| p.iter_mut().zip(g).for_each(|(p, &g)| k.plain(p, g));
                if parallel {
                    p.par_chunks_mut(PAR_CHUNK).zip(g.par_chunks(PAR_CHUNK)).for_each(|(p, g)| run(p, g));
                } else {
                    run(p, g);
                }
            }
            Some(buf) => {
                let b = buf.slice_mut::<T>()?;
                let run = |p: &mut [T], g: &[T], b: &mut [T]| {
                    p.iter_mut().zip(g).zip(b.iter_mut()).for_each(|((p, &g), b)| k.with_momentum(p, g, b))
                };
                if parallel {
                    p.par_chunks_mut(PAR_CHUNK)
                        .zip(g.par_chunks(PAR_CHUNK))
                        .zip(b.par_chunks_mut(PAR_CHUNK))
                        .for_each(|((p, g), b)| run(p, g, b));
                } else {
                    run(p, g, b);
                }
            }
        }
    });
    Ok(())
}

/// Adam hyper-parameters already cast to the parameter's dtype (Note [Optimizer arithmetic]).
#[derive(Clone, Copy)]
struct Adam<T> {
    /// `1 - lr*wd` (AdamW) applied to the parameter first.
    decay: Option<T>,
    /// L2 weight decay (Adam) added to the gradient.
    l2: Option<T>,
    /// `1 - beta1`, the lerp weight.
    lerp_weight: T,
    beta2: T,
    one_minus_beta2: T,
    /// `sqrt(1 - beta2^t)`.
    bias_correction2_sqrt: T,
    eps: T,
    /// `-lr / (1 - beta1^t)`.
    neg_step_size: T,
}

impl<T: Float> Adam<T> {
    /// One element's update. The const flags select the variant at compile time, so the loop over
    /// elements has no branches and vectorizes (decoupled decay, L2 decay, which side of ATen's lerp).
    #[inline(always)]
    fn update<const DECAY: bool, const L2: bool, const LOW_WEIGHT: bool>(
        &self,
        p: &mut T,
        g: T,
        m: &mut T,
        v: &mut T,
        decay: T,
        wd: T,
    ) {
        let mut param = *p;
        let mut g = g;
        if DECAY {
            param *= decay; // param.mul_(1 - lr*wd)
        }
        if L2 {
            g += wd * param; // grad.add(param, alpha=wd)
        }
        // exp_avg.lerp_(grad, 1 - beta1), with ATen's two-sided lerp formula.
        let w = self.lerp_weight;
        let m_new = if LOW_WEIGHT { *m + w * (g - *m) } else { g - (g - *m) * (T::one() - w) };
        // exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1-beta2)
        let v_new = *v * self.beta2 + self.one_minus_beta2 * g * g;
        // denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
        let denom = v_new.sqrt() / self.bias_correction2_sqrt + self.eps;
        // param.addcdiv_(exp_avg, denom, value=-step_size)
        *p = param + self.neg_step_size * m_new / denom;
        *m = m_new;
        *v = v_new;
    }

    fn update_all<const DECAY: bool, const L2: bool, const LOW_WEIGHT: bool>(
        &self,
        p: &mut [T],
        g: &[T],
        m: &mut [T],
        v: &mut [T],
    ) {
        let decay = self.decay.unwrap_or(T::one());
        let wd = self.l2.unwrap_or(T::zero());
        for (((p, &g), m), v) in p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
            self.update::<DECAY, L2, LOW_WEIGHT>(p, g, m, v, decay, wd);
        }
    }

    fn update_chunk(&self, p: &mut [T], g: &[T], m: &mut [T], v: &mut [T]) {
        let low = self.lerp_weight < T::of(0.5);
        match (self.decay.is_some(), self.l2.is_some(), low) {
            (false, false, true) => self.update_all::<false, false, true>(p, g, m, v),
            (false, false, false) => self.update_all::<false, false, false>(p, g, m, v),
            (true, false, true) => self.update_all::<true, false, true>(p, g, m, v),
            (true, false, false) => self.update_all::<true, false, false>(p, g, m, v),
            (false, true, true) => self.update_all::<false, true, true>(p, g, m, v),
            (false, true, false) => self.update_all::<false, true, false>(p, g, m, v),
            (true, true, true) => self.update_all::<true, true, true>(p, g, m, v),
            (true, true, false) => self.update_all::<true, true, false>(p, g, m, v),
        }
    }
}

impl<T: Float> Adam<T> {
    /// The hyper-parameters of one step, derived in f64 (Python floats, as torch.optim computes
    /// them) and cast to the parameter's dtype (Note [Optimizer arithmetic]).
    fn of_step(step: AdamStep) -> Adam<T> {
        let AdamStep { step, lr, betas, eps, weight_decay, decoupled } = step;
        let (beta1, beta2) = betas;
        let t = step as f64;
        let bias_correction1 = 1.0 - beta1.powf(t);
        let bias_correction2 = 1.0 - beta2.powf(t);
        Adam {
            decay: (weight_decay != 0.0 && decoupled).then(|| T::of(1.0 - lr * weight_decay)),
            l2: (weight_decay != 0.0 && !decoupled).then(|| T::of(weight_decay)),
            lerp_weight: T::of(1.0 - beta1),
            beta2: T::of(beta2),
            one_minus_beta2: T::of(1.0 - beta2),
            bias_correction2_sqrt: T::of(bias_correction2.powf(0.5)),
            eps: T::of(eps),
            neg_step_size: T::of(-(lr / bias_correction1)),
        }
    }
}

/// `run` over matching chunks of a parameter, its gradient and its two moments: in parallel chunks
/// of `PAR_CHUNK` for a large tensor (element-wise, so the result does not depend on the threads).
fn over_chunks<P: Send, G: Sync, M: Send>(
    p: &mut [P],
    g: &[G],
    m: &mut [M],
    v: &mut [M],
    run: impl Fn(&mut [P], &[G], &mut [M], &mut [M]) + Sync + Send,
) {
    if p.len() >= 2 * PAR_CHUNK {
        p.par_chunks_mut(PAR_CHUNK)
            .zip(g.par_chunks(PAR_CHUNK))
            .zip(m.par_chunks_mut(PAR_CHUNK))
            .zip(v.par_chunks_mut(PAR_CHUNK))
            .for_each(|(((p, g), m), v)| run(p, g, m, v));
    } else {
        run(p, g, m, v);
    }
}

// Note [Compact optimizer state]
// Adam's two moments are most of a model's training memory (twice its parameters). Stored compact,
// they are read into f32, updated by exactly the f32 arithmetic above, and stored back:
// - bf16: each moment rounded to nearest even (half the bytes);
// - 8-bit, block-wise (Dettmers et al., "8-bit Optimizers via Block-wise Quantization", 2022, as
//   bitsandbytes' Adam8bit): blocks of QUANT_BLOCK values, each value stored as the code (one byte) of
//   the nearest entry of a dynamic map of 256 values in [-1, 1] times its block's absolute maximum
//   (one f32 per block). The map spends its codes by decade, twice as many per decade toward 1, so
//   small moments keep their relative precision: exp_avg uses a signed map; exp_avg_sq is stored as
//   its square root (the scale Adam divides by, and half the decades to cover) with an unsigned map
//   of twice the codes per decade, a positive value never rounded to zero. Rounding exp_avg_sq to zero
//   would leave exp_avg over eps alone (a step ten thousand times too large: training diverged within
//   a few steps when it was allowed); its smallest code only shortens such a step. A quarter of the
//   bytes, and a block's error is relative to its largest value.
// Both change the numbers (opt-in: `--optimizer-state`). Every path computes the same bits: the
// blocks are updated independently, element by element, in a fixed order.

/// Values per block of the 8-bit state (one absolute maximum each).
pub const QUANT_BLOCK: usize = 2048;

/// The dynamic map of 8-bit moments (Note [Compact optimizer state]), sorted ascending: signed for
/// exp_avg (0, 1, and per decade k of seven, 10^-k-scaled means of 2^(6-k) steps of [0.1, 1], with
/// their negatives), unsigned for exp_avg_sq (0, 1, and 2^(7-k) steps per decade).
pub fn dynamic_map(signed: bool) -> [f32; 256] {
    let mut values = vec![0.0f64, 1.0];
    for k in 0..7 {
        let steps = if signed { 1usize << (6 - k) } else { 1usize << (7 - k) };
        let scale = 10f64.powi(-(k as i32));
        for i in 0..steps {
            // The middle of the i-th of `steps` equal parts of [0.1, 1].
            let lo = 0.1 + 0.9 * i as f64 / steps as f64;
            let hi = 0.1 + 0.9 * (i + 1) as f64 / steps as f64;
            let mean = scale * (lo + hi) / 2.0;
            values.push(mean);
            if signed {
                values.push(-mean);
            }
        }
    }
    values.sort_by(f64::total_cmp);
    let mut map = [0.0f32; 256];
    for (m, v) in map.iter_mut().zip(&values) {
        *m = *v as f32;
    }
    debug_assert_eq!(values.len(), 256);
    map
}

/// A dynamic map with what finds a value's code fast: the code of `x` is the number of midpoints
/// between consecutive entries below `x` (the nearest entry, the lower one on a tie; the GPU kernel
/// counts the same midpoints by binary search). On the cpu, a table by `x`'s sign, exponent and top
/// eight mantissa bits holds that count at its interval's start; an interval holds at most one
/// midpoint (the entries are at least 1% apart, the intervals 0.4% wide), and that one can only be
/// the next, so one lookup and one comparison replace eight dependent ones (which made 8-bit Adam
/// ten times slower than f32 Adam on mlp), and the table is a byte per interval (14 KiB).
pub struct Codebook {
    pub map: [f32; 256],
    /// `mids[j]` between entries j and j + 1; `mids[255]` is +inf.
    pub mids: [f32; 256],
    /// Per interval: the count of midpoints below it.
    below: Vec<u8>,
    /// The codes of tiny values (below the table's exponents): positive, and zero or negative.
    tiny: (u8, u8),
}

/// The table's exponents: |x| in [2^-TABLE_EXPONENTS, 2), each in 256 intervals.
const TABLE_EXPONENTS: u32 = 28;

impl Codebook {
    pub fn new(map: [f32; 256]) -> Codebook {
        let mut mids = [f32::INFINITY; 256];
        for j in 0..255 {
            mids[j] = (map[j] + map[j + 1]) * 0.5;
        }
        let count = |x: f32| mids.iter().filter(|&&m| m < x).count().min(255) as u8;
        let n = 2 * TABLE_EXPONENTS as usize * 256;
        let mut below = vec![0u8; n];
        for (slot, b) in below.iter_mut().enumerate() {
            let (negative, exponent, top) = (slot / (n / 2) == 1, (slot % (n / 2)) / 256, slot % 256);
            // The interval's floats: magnitudes from its first bits to the next interval's.
            let e = 127 - (TABLE_EXPONENTS - 1) + exponent as u32;
            let lo_bits = (e << 23) | ((top as u32) << 15);
            let (lo, hi_last) = (f32::from_bits(lo_bits), f32::from_bits(lo_bits + (1 << 15) - 1));
            // Its values in increasing order run from `first` to `last`.
            let (first, last) = if negative { (-hi_last, -lo) } else { (lo, hi_last) };
            *b = count(first);
            debug_assert!(
                mids.iter().filter(|&&m| m >= first && m < last).count() <= 1,
                "intervals narrower than the map's spacing ({first})"
            );
        }
        Codebook { map, mids, below, tiny: (count(f32::from_bits(1)), count(0.0)) }
    }

    /// The code of `x` (normalized: in [-1, 1]).
    #[inline]
    pub fn code(&self, x: f32) -> u8 {
        let bits = x.to_bits();
        let exponent = (bits >> 23) & 0xff;
        let low = 127 - (TABLE_EXPONENTS - 1);
        if exponent < low {
            return if x > 0.0 { self.tiny.0 } else { self.tiny.1 };
        }
        if exponent > 127 {
            // |x| of 2 or more (NaN too): the end of the map on its side.
            return if x > 0.0 { 255 } else { 0 };
        }
        let n = TABLE_EXPONENTS as usize * 256;
        let slot = (bits >> 31) as usize * n + (exponent - low) as usize * 256 + ((bits >> 15) & 0xff) as usize;
        // The one midpoint the interval may hold is the next one: counted when below x.
        let below = self.below[slot];
        below + u8::from(self.mids[below as usize] < x)
    }

    /// The code by counting midpoints one by one (what `code` must equal).
    pub fn code_by_count(&self, x: f32) -> u8 {
        self.mids.iter().filter(|&&m| m < x).count().min(255) as u8
    }
}

/// The codebooks of the two moments' maps, exp_avg's (signed) and exp_avg_sq's (built once).
pub fn codebooks() -> &'static (Codebook, Codebook) {
    static BOOKS: std::sync::OnceLock<(Codebook, Codebook)> = std::sync::OnceLock::new();
    BOOKS.get_or_init(|| (Codebook::new(dynamic_map(true)), Codebook::new(dynamic_map(false))))
}

/// One block of `values` stored as codes and an absolute maximum (0 for a block of zeros); with
/// `keep_positive`, a positive value takes at least the smallest positive code.
fn store_block(book: &Codebook, values: &[f32], codes: &mut [u8], keep_positive: bool) -> f32 {
    let absmax = values.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let inv = if absmax > 0.0 { 1.0 / absmax } else { 0.0 };
    let smallest_positive = book.map.iter().position(|&m| m > 0.0).unwrap_or(255) as u8;
    for (c, &v) in codes.iter_mut().zip(values) {
        let code = book.code(v * inv);
        *c = if keep_positive && v > 0.0 { code.max(smallest_positive) } else { code };
    }
    absmax
}

/// One Adam / AdamW step of an f32 parameter whose moments are bf16 (Note [Compact optimizer
/// state]): read, updated in f32, stored rounded to nearest even.
pub fn adam_update_bf16_state(
    param: View<'_>,
    grad: View<'_>,
    exp_avg: View<'_>,
    exp_avg_sq: View<'_>,
    step: AdamStep,
) -> Result<()> {
    use half::bf16;
    let k = Adam::<f32>::of_step(step);
    let (p, g) = (param.slice_mut::<f32>()?, grad.slice::<f32>()?);
    let (m, v) = (exp_avg.slice_mut::<bf16>()?, exp_avg_sq.slice_mut::<bf16>()?);
    const PART: usize = 1024;
    over_chunks(p, g, m, v, |p, g, m, v| {
        let (mut m32, mut v32) = ([0.0f32; PART], [0.0f32; PART]);
        for (((p, g), m), v) in p.chunks_mut(PART).zip(g.chunks(PART)).zip(m.chunks_mut(PART)).zip(v.chunks_mut(PART)) {
            let n = p.len();
            for i in 0..n {
                (m32[i], v32[i]) = (m[i].to_f32(), v[i].to_f32());
            }
            k.update_chunk(p, g, &mut m32[..n], &mut v32[..n]);
            for i in 0..n {
                (m[i], v[i]) = (bf16::from_f32(m32[i]), bf16::from_f32(v32[i]));
            }
        }
    });
    Ok(())
}

/// One Adam / AdamW step of an f32 parameter whose moments are 8-bit block-wise (Note [Compact
/// optimizer state]): each block of [`QUANT_BLOCK`] read through its absolute maxima (exp_avg's,
/// and the square root of exp_avg_sq's), updated in f32, and stored again with the new maxima.
pub fn adam_update_8bit(
    param: View<'_>,
    grad: View<'_>,
    m_codes: View<'_>,
    m_absmax: View<'_>,
    v_codes: View<'_>,
    v_absmax: View<'_>,
    step: AdamStep,
) -> Result<()> {
    let k = Adam::<f32>::of_step(step);
    let (signed, unsigned) = codebooks();
    let (p, g) = (param.slice_mut::<f32>()?, grad.slice::<f32>()?);
    let (mc, vc) = (m_codes.slice_mut::<u8>()?, v_codes.slice_mut::<u8>()?);
    let (ma, va) = (m_absmax.slice_mut::<f32>()?, v_absmax.slice_mut::<f32>()?);
    crate::error::check_len("adam_update_8bit absmax", ma.len().min(va.len()), p.len().div_ceil(QUANT_BLOCK))?;
    crate::error::check_len("adam_update_8bit codes", mc.len().min(vc.len()), p.len())?;
    let block =
        |(((((p, g), mc), vc), ma), va): (((((&mut [f32], &[f32]), &mut [u8]), &mut [u8]), &mut f32), &mut f32)| {
            let n = p.len();
            let (mut m32, mut v32) = ([0.0f32; QUANT_BLOCK], [0.0f32; QUANT_BLOCK]);
            for i in 0..n {
                m32[i] = signed.map[mc[i] as usize] * *ma;
                let root = unsigned.map[vc[i] as usize] * *va;
                v32[i] = root * root;
            }
            k.update_chunk(p, g, &mut m32[..n], &mut v32[..n]);
            *ma = store_block(signed, &m32[..n], mc, false);
            for v in &mut v32[..n] {
                *v = v.sqrt();
            }
            *va = store_block(unsigned, &v32[..n], vc, true);
        };
    let n = p.len();
    p.par_chunks_mut(QUANT_BLOCK)
        .zip(g.par_chunks(QUANT_BLOCK))
        .zip(mc[..n].par_chunks_mut(QUANT_BLOCK))
        .zip(vc[..n].par_chunks_mut(QUANT_BLOCK))
        .zip(ma.par_iter_mut())
        .zip(va.par_iter_mut())
        .for_each(block);
    Ok(())
}

/// One Adam / AdamW step over `param`, `exp_avg` and `exp_avg_sq`, all contiguous, same dtype.
pub fn adam_update(
    param: View<'_>,
    grad: View<'_>,
    exp_avg: View<'_>,
    exp_avg_sq: View<'_>,
    step: AdamStep,
) -> Result<()> {
    with_float!(param.dtype(), "adam_update", T => {
        let k = Adam::<T>::of_step(step);
        let (p, g) = (param.slice_mut::<T>()?, grad.slice::<T>()?);
        let (m, v) = (exp_avg.slice_mut::<T>()?, exp_avg_sq.slice_mut::<T>()?);
        over_chunks(p, g, m, v, |p, g, m, v| k.update_chunk(p, g, m, v));
    });
    Ok(())
}

/// `grad *= inv_scale` in place (contiguous); `found_inf` becomes true when any value is inf or NaN
/// before or after the multiplication (it is left alone otherwise).
pub fn unscale(grad: View<'_>, inv_scale: f64, found_inf: &mut bool) -> Result<()> {
    let bad = with_float!(grad.dtype(), "unscale_", T => {
        let inv = T::of(inv_scale);
        let g = grad.slice_mut::<T>()?;
        let run = |c: &mut [T]| {
            let mut bad = false;
            for v in c.iter_mut() {
                let x = *v;
                let y = x * inv;
                bad |= !x.is_finite() || !y.is_finite();
                *v = y;
            }
            bad
        };
        if g.len() >= 2 * PAR_CHUNK {
            g.par_chunks_mut(PAR_CHUNK).map(run).reduce(|| false, |a, b| a || b)
        } else {
            run(g)
        }
    });
    *found_inf |= bad;
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_dynamic_maps_span_minus_one_to_one_sorted_with_zero_and_one() {
        for signed in [true, false] {
            let map = dynamic_map(signed);
            assert!(map.windows(2).all(|w| w[0] < w[1]), "strictly increasing");
            assert!(map.contains(&0.0) && map[255] == 1.0);
            assert_eq!(map[0] < 0.0, signed);
            // Entries by decade: more toward 1; the smallest magnitude is 10^-6 scaled.
            let smallest = map.iter().filter(|&&v| v > 0.0).fold(1.0f32, |m, &v| m.min(v));
            assert!((1e-7..1e-6).contains(&smallest), "{smallest}");
        }
        let map = dynamic_map(true);
        let positives: Vec<f32> = map.iter().copied().filter(|&v| v > 0.0 && v < 1.0).collect();
        assert!(positives.iter().all(|&v| map.contains(&-v)), "symmetric but for 1");
    }

    /// The table lookup equals counting midpoints, at every midpoint, the floats beside it, the
    /// interval edges and a million seeded values.
    #[test]
    fn codebook_lookups_equal_counting_midpoints() {
        for signed in [true, false] {
            let book = Codebook::new(dynamic_map(signed));
            let mut xs = vec![0.0f32, -0.0, 1.0, -1.0, 1.5, -1.5, f32::MIN_POSITIVE, 1e-30, -1e-30];
            for &m in &book.mids[..255] {
                xs.extend([m, f32::from_bits(m.to_bits() + 1), f32::from_bits(m.to_bits() - 1)]);
            }
            let mut s = 0x9E37_79B9_7F4A_7C15u64;
            for _ in 0..1_000_000 {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                // Magnitudes spread over ten decades, both signs.
                let magnitude = 10f32.powf(-((s >> 11) as f32 / (1u64 << 53) as f32) * 10.0);
                xs.push(if s & 1 == 0 { magnitude } else { -magnitude });
            }
            for x in xs {
                assert_eq!(book.code(x), book.code_by_count(x), "x = {x:e} ({:#x})", x.to_bits());
            }
        }
    }

    /// Stored and read back, a block's values are within half the map's local spacing of the truth
    /// (relative to the block's maximum), positive values stay positive, and zeros stay zero.
    #[test]
    fn a_block_reads_back_within_its_maps_spacing() {
        let (signed, unsigned) = codebooks();
        let values: Vec<f32> =
            (0..QUANT_BLOCK).map(|i| ((i as f32 * 0.37).sin() * 3.0) * 10f32.powi(-((i % 9) as i32))).collect();
        for (book, keep) in [(signed, false), (unsigned, true)] {
            let values: Vec<f32> = if keep { values.iter().map(|v| v.abs()).collect() } else { values.clone() };
            let mut codes = vec![0u8; QUANT_BLOCK];
            let absmax = store_block(book, &values, &mut codes, keep);
            assert_eq!(absmax, values.iter().fold(0.0f32, |m, v| m.max(v.abs())));
            for (&v, &c) in values.iter().zip(&codes) {
                let back = book.map[c as usize] * absmax;
                let j = c as usize;
                let spacing = (book.map[(j + 1).min(255)] - book.map[j.saturating_sub(1)]).abs() * absmax;
                if keep && v > 0.0 {
                    assert!(back > 0.0, "{v} read back as {back}");
                    assert!((back - v).abs() <= spacing.max(book.map[1] * absmax), "{v} read back as {back}");
                } else {
                    assert!((back - v).abs() <= spacing / 2.0 + 1e-12, "{v} read back as {back}");
                }
            }
        }
        let mut codes = vec![7u8; 4];
        assert_eq!(store_block(signed, &[0.0; 4], &mut codes, false), 0.0);
        assert!(codes.iter().all(|&c| signed.map[c as usize] == 0.0), "zeros stay zero");
    }

    use super::*;

    /// `exp_avg.lerp_(grad, w)` as ATen computes it: `m + w (g - m)` for a weight below one half,
    /// `g - (g - m)(1 - w)` from one half up. The two round differently, so the first moment's bits
    /// say which was taken.
    #[test]
    fn the_first_moment_follows_atens_two_sided_lerp() {
        let cases: Vec<(f32, f32)> =
            (0..2000).map(|i| ((i as f32 * 0.37).sin() * 3.0, (i as f32 * 0.91).cos() * 2.0)).collect();
        for beta1 in [0.9f32, 0.3] {
            let w = 1.0 - beta1;
            let k = Adam::<f32> {
                decay: None,
                l2: None,
                lerp_weight: w,
                beta2: 0.999,
                one_minus_beta2: 0.001,
                bias_correction2_sqrt: 1.0,
                eps: 1e-8,
                neg_step_size: -1e-3,
            };
            let (g, mut m): (Vec<f32>, Vec<f32>) = cases.iter().copied().unzip();
            let (mut p, mut v) = (vec![1.0f32; g.len()], vec![0.5f32; g.len()]);
            let m0 = m.clone();
            k.update_chunk(&mut p, &g, &mut m, &mut v);
            let low = |g: f32, m: f32| m + w * (g - m);
            let high = |g: f32, m: f32| g - (g - m) * (1.0 - w);
            let (aten, other): (&dyn Fn(f32, f32) -> f32, &dyn Fn(f32, f32) -> f32) =
                if w < 0.5 { (&low, &high) } else { (&high, &low) };
            for ((&g, &m0), &m) in g.iter().zip(&m0).zip(&m) {
                assert_eq!(m.to_bits(), aten(g, m0).to_bits(), "beta1 {beta1}: g {g}, exp_avg {m0}");
            }
            assert!(
                g.iter().zip(&m0).any(|(&g, &m0)| aten(g, m0).to_bits() != other(g, m0).to_bits()),
                "beta1 {beta1}: the cases tell the two formulas apart"
            );
        }
    }
}
