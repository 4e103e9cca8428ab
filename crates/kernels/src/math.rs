//! Element-wise f32 math on slices — exact (erf) GELU, its derivative and backward, and `exp` —
//! with one path per instruction set ([`Isa`]): AVX-512, AVX2/FMA and portable Rust.
//!
//! The approximations (`math/approx.rs`: a rational approximation of the normal tail times an
//! exponential, see there) are written once against a small vector trait (`math/lanes.rs`) that
//! each path implements; the portable path reproduces the SIMD semantics (fused multiply-adds
//! included) in plain Rust, so the three paths agree bit for bit (checked on all 2^32 inputs)
//! and the portable one is itself an accurate reference. Worst errors against f64
//! (`libm::erfc`, `f64::exp`) over the tests' inputs: `gelu` 2.9 ulp, the normal CDF behind it
//! 1.9 ulp (the `erf` it implies 1.4e-7 absolute), `exp` 0.88 ulp (subnormal results in units of
//! the smallest subnormal); the GELU derivative 2.5 ulp of the size of its terms
//! `|Φ(x)| + |x φ(x)|` (a relative error is meaningless at its root near `x = -0.75`, and is the
//! same 2.5 ulp wherever the derivative is at least half that size). Special values:
//! `gelu(±0) = ±0`, `gelu(inf) = inf`, `gelu(-inf) = -0`, derivative `1` at `inf` and `0` at
//! `-inf`, `exp` overflows to inf above 88.72 and underflows through the subnormals to 0 below
//! -103.97; NaN propagates everywhere.
//!
//! An `isa` this CPU does not support runs the portable path (no unsupported instruction is ever
//! executed). Slices are processed in whole vectors plus one masked tail vector, single-threaded.

use crate::isa::Isa;

mod approx;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
mod lanes;
mod portable;

use lanes::Lanes;

/// A kernel of one input and one output.
trait Unary {
    /// # Safety
    /// The CPU supports `V`'s instruction set.
    unsafe fn apply<V: Lanes>(x: V) -> V;
}

/// A kernel of one input and two outputs.
trait Dual {
    /// # Safety
    /// The CPU supports `V`'s instruction set.
    unsafe fn apply<V: Lanes>(x: V) -> (V, V);
}

/// A kernel of two inputs (`x` and an incoming gradient `g`) and one output.
trait Fused {
    /// # Safety
    /// The CPU supports `V`'s instruction set.
    unsafe fn apply<V: Lanes>(x: V, g: V) -> V;
}

struct Gelu;
impl Unary for Gelu {
    #[inline(always)]
    unsafe fn apply<V: Lanes>(x: V) -> V {
        approx::gelu(x)
    }
}

struct Exp;
impl Unary for Exp {
    #[inline(always)]
    unsafe fn apply<V: Lanes>(x: V) -> V {
        approx::exp(x)
    }
}

struct GeluWithDerivative;
impl Dual for GeluWithDerivative {
    #[inline(always)]
    unsafe fn apply<V: Lanes>(x: V) -> (V, V) {
        approx::gelu_with_derivative(x)
    }
}

struct GeluBackward;
impl Fused for GeluBackward {
    #[inline(always)]
    unsafe fn apply<V: Lanes>(x: V, g: V) -> V {
        approx::gelu_backward(x, g)
    }
}

/// Runs `K` over `n` elements on `isa`'s path, or the portable one when the CPU lacks `isa`.
///
/// # Safety
/// As [`lanes::map_unary`] (minus the CPU requirement, which is checked here).
unsafe fn unary<K: Unary>(isa: Isa, n: usize, x: *const f32, y: *mut f32) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 if isa.is_supported() => avx512::unary::<K>(n, x, y),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2Fma if isa.is_supported() => avx2::unary::<K>(n, x, y),
        _ => portable::unary::<K>(n, x, y),
    }
}

/// As [`unary`] for a kernel of two outputs.
///
/// # Safety
/// As [`lanes::map_dual`] (minus the CPU requirement, which is checked here).
unsafe fn dual<K: Dual>(isa: Isa, n: usize, x: *const f32, y: *mut f32, d: *mut f32) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 if isa.is_supported() => avx512::dual::<K>(n, x, y, d),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2Fma if isa.is_supported() => avx2::dual::<K>(n, x, y, d),
        _ => portable::dual::<K>(n, x, y, d),
    }
}

/// As [`unary`] for a kernel of two inputs.
///
/// # Safety
/// As [`lanes::map_fused`] (minus the CPU requirement, which is checked here).
unsafe fn fused<K: Fused>(isa: Isa, n: usize, x: *const f32, g: *const f32, out: *mut f32) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 if isa.is_supported() => avx512::fused::<K>(n, x, g, out),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2Fma if isa.is_supported() => avx2::fused::<K>(n, x, g, out),
        _ => portable::fused::<K>(n, x, g, out),
    }
}

/// `y = gelu(x) = x Φ(x) = 0.5 x (1 + erf(x/√2))`, the exact (erf) GELU.
///
/// # Panics
/// If the slices differ in length.
pub fn gelu(isa: Isa, x: &[f32], y: &mut [f32]) {
    assert_eq!(x.len(), y.len(), "gelu: x and y differ in length");
    // SAFETY: both slices hold x.len() elements, and a `&` and a `&mut` cannot overlap.
    unsafe { unary::<Gelu>(isa, x.len(), x.as_ptr(), y.as_mut_ptr()) }
}

/// `y = gelu(x)` and `d = gelu'(x) = Φ(x) + x φ(x)` from one evaluation of the normal tail;
/// `g * d` equals [`gelu_backward`]`(x, g)` bit for bit.
///
/// # Panics
/// If the slices differ in length.
pub fn gelu_with_derivative(isa: Isa, x: &[f32], y: &mut [f32], d: &mut [f32]) {
    assert_eq!(x.len(), y.len(), "gelu_with_derivative: x and y differ in length");
    assert_eq!(x.len(), d.len(), "gelu_with_derivative: x and d differ in length");
    // SAFETY: the slices hold x.len() elements each and cannot overlap (one `&`, two `&mut`).
    unsafe { dual::<GeluWithDerivative>(isa, x.len(), x.as_ptr(), y.as_mut_ptr(), d.as_mut_ptr()) }
}

/// [`gelu_with_derivative`] with the derivative written over its input: `y = gelu(x)`, then
/// `xd = gelu'(x)` where `xd` held `x` (bit for bit the same values).
///
/// # Panics
/// If the slices differ in length.
pub fn gelu_with_derivative_over_input(isa: Isa, xd: &mut [f32], y: &mut [f32]) {
    assert_eq!(xd.len(), y.len(), "gelu_with_derivative_over_input: x and y differ in length");
    let p = xd.as_mut_ptr();
    // SAFETY: both slices hold xd.len() elements; the kernel reads each vector of x before it
    // writes the derivative back through the same pointer, and `y` (a `&mut`) overlaps neither.
    unsafe { dual::<GeluWithDerivative>(isa, xd.len(), p, y.as_mut_ptr(), p) }
}

/// `out = g * gelu'(x)`: GELU's backward for the incoming gradient `g`.
///
/// # Panics
/// If the slices differ in length.
pub fn gelu_backward(isa: Isa, x: &[f32], g: &[f32], out: &mut [f32]) {
    assert_eq!(x.len(), g.len(), "gelu_backward: x and g differ in length");
    assert_eq!(x.len(), out.len(), "gelu_backward: x and out differ in length");
    // SAFETY: the slices hold x.len() elements each, and `out` (a `&mut`) overlaps neither input.
    unsafe { fused::<GeluBackward>(isa, x.len(), x.as_ptr(), g.as_ptr(), out.as_mut_ptr()) }
}

/// `g = g * gelu'(x)` in place (bit for bit [`gelu_backward`]).
///
/// # Panics
/// If the slices differ in length.
pub fn gelu_backward_inplace(isa: Isa, x: &[f32], g: &mut [f32]) {
    assert_eq!(x.len(), g.len(), "gelu_backward_inplace: x and g differ in length");
    let p = g.as_mut_ptr();
    // SAFETY: both slices hold x.len() elements; the kernel reads each vector of `g` before it
    // writes it back through the same pointer, and `x` (a `&`) cannot overlap `g`.
    unsafe { fused::<GeluBackward>(isa, x.len(), x.as_ptr(), p, p) }
}

/// `x = g * gelu'(x)` in place over the input (bit for bit [`gelu_backward`]).
///
/// # Panics
/// If the slices differ in length.
pub fn gelu_backward_over_input(isa: Isa, g: &[f32], x: &mut [f32]) {
    assert_eq!(x.len(), g.len(), "gelu_backward_over_input: x and g differ in length");
    let p = x.as_mut_ptr();
    // SAFETY: both slices hold x.len() elements; the kernel reads each vector of `x` before it
    // writes the result back through the same pointer, and `g` (a `&`) cannot overlap `x`.
    unsafe { fused::<GeluBackward>(isa, x.len(), p, g.as_ptr(), p) }
}

/// `y = e^x`.
///
/// # Panics
/// If the slices differ in length.
pub fn exp(isa: Isa, x: &[f32], y: &mut [f32]) {
    assert_eq!(x.len(), y.len(), "exp: x and y differ in length");
    // SAFETY: both slices hold x.len() elements, and a `&` and a `&mut` cannot overlap.
    unsafe { unary::<Exp>(isa, x.len(), x.as_ptr(), y.as_mut_ptr()) }
}

/// `y = e^y` in place (bit for bit [`exp`]).
pub fn exp_inplace(isa: Isa, y: &mut [f32]) {
    let p = y.as_mut_ptr();
    // SAFETY: the slice holds y.len() elements; the kernel reads each vector before it writes it
    // back through the same pointer.
    unsafe { unary::<Exp>(isa, y.len(), p, p) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::f64::consts::{PI, SQRT_2};

    // ---- references (f64) ----

    fn cdf_ref(x: f64) -> f64 {
        if x < 0.0 {
            0.5 * libm::erfc(-x / SQRT_2)
        } else {
            1.0 - 0.5 * libm::erfc(x / SQRT_2)
        }
    }

    fn pdf_ref(x: f64) -> f64 {
        (-0.5 * x * x).exp() / (2.0 * PI).sqrt()
    }

    fn gelu_ref(x: f64) -> f64 {
        if x == f64::NEG_INFINITY {
            return -0.0;
        }
        x * cdf_ref(x)
    }

    fn derivative_ref(x: f64) -> f64 {
        if x.is_infinite() {
            return if x > 0.0 { 1.0 } else { 0.0 };
        }
        cdf_ref(x) + x * pdf_ref(x)
    }

    /// The size of the derivative's terms, `|Φ(x)| + |x φ(x)|`: its error is measured in ulps of
    /// this (the derivative itself crosses zero near -0.75, where no f32 formula keeps a
    /// relative error).
    fn derivative_scale(x: f64) -> f64 {
        if x.is_infinite() {
            return derivative_ref(x);
        }
        cdf_ref(x).abs() + (x * pdf_ref(x)).abs()
    }

    // ---- error measures ----

    /// The spacing of f32 at `|v|` (the smallest subnormal at and below the normal range).
    fn ulp_at(v: f64) -> f64 {
        let a = (v.abs() as f32).min(f32::MAX);
        if a < f32::MIN_POSITIVE {
            return f64::from(f32::from_bits(1));
        }
        f64::from(f32::from_bits(a.to_bits() & 0x7f80_0000)) * f64::powi(2.0, -23)
    }

    /// `|got - want|` in f32 ulps at `scale` (0 when both are the same inf or both NaN, inf when
    /// only one is).
    fn ulps_at(got: f32, want: f64, scale: f64) -> f64 {
        if got.is_nan() || want.is_nan() {
            return if got.is_nan() && want.is_nan() { 0.0 } else { f64::INFINITY };
        }
        let rounded = want as f32;
        if got.is_infinite() || rounded.is_infinite() {
            return if got == rounded { 0.0 } else { f64::INFINITY };
        }
        (f64::from(got) - want).abs() / ulp_at(scale)
    }

    fn ulps(got: f32, want: f64) -> f64 {
        ulps_at(got, want, want)
    }

    // ---- inputs ----

    /// A small deterministic generator.
    struct Lcg(u64);
    impl Lcg {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            self.0 >> 32
        }
        fn unit(&mut self) -> f64 {
            self.next() as f64 / (1u64 << 32) as f64
        }
    }

    const SPECIALS: [f32; 30] = [
        0.0,
        -0.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        1.0,
        -1.0,
        10.0,
        -10.0,
        100.0,
        -100.0,
        1e30,
        -1e30,
        f32::MAX,
        f32::MIN,
        f32::MIN_POSITIVE,
        -f32::MIN_POSITIVE,
        1e-45,
        -1e-45,
        -0.751_791_5,
        -0.751_791_6,
        13.3,
        -13.3,
        14.5,
        -14.5,
        16.0,
        -16.0,
        16.5,
        -16.5,
        -1e-20,
    ];

    /// Every 1e-3 over `[lo, hi]`, random values (uniform on `[-20, 20]`, log-uniform magnitudes
    /// `2^-40..2^8` of either sign, random finite bit patterns) and the special values.
    fn inputs(lo: f64, hi: f64) -> Vec<f32> {
        let steps = ((hi - lo) * 1000.0).round() as i64;
        let mut v: Vec<f32> = (0..=steps).map(|i| (lo + i as f64 * 1e-3) as f32).collect();
        let mut rng = Lcg(7);
        for _ in 0..8192 {
            v.push((rng.unit() * 40.0 - 20.0) as f32);
        }
        for _ in 0..8192 {
            let mag = (rng.unit() * 48.0 - 40.0).exp2();
            v.push(if rng.next() & 1 == 0 { mag as f32 } else { -mag as f32 });
        }
        while v.len() % 1000 != 7 {
            let x = f32::from_bits(rng.next() as u32);
            if x.is_finite() {
                v.push(x);
            }
        }
        v.extend(SPECIALS);
        v
    }

    fn gelu_inputs() -> Vec<f32> {
        inputs(-12.0, 12.0)
    }

    fn exp_inputs() -> Vec<f32> {
        let mut v = inputs(-110.0, 95.0);
        v.extend([88.722_83, 88.722_84, 88.73, -87.336_54, -87.336_55, -103.972_08, -103.972_07, -104.0, -200.0]);
        v
    }

    /// Incoming gradients for the backward: varied magnitudes and signs.
    fn grads(n: usize) -> Vec<f32> {
        let mut rng = Lcg(11);
        (0..n).map(|_| ((rng.unit() * 2.0 - 1.0) * (rng.unit() * 8.0 - 4.0).exp2()) as f32).collect()
    }

    // ---- running every function on one isa ----

    /// Every output of every function, on `isa`: (name, values).
    fn run_all(isa: Isa, x: &[f32], g: &[f32], xe: &[f32]) -> Vec<(&'static str, Vec<f32>)> {
        let n = x.len();
        let mut y = vec![0.0; n];
        gelu(isa, x, &mut y);
        let (mut y2, mut d) = (vec![0.0; n], vec![0.0; n]);
        gelu_with_derivative(isa, x, &mut y2, &mut d);
        let mut b = vec![0.0; n];
        gelu_backward(isa, x, g, &mut b);
        let mut bi = g.to_vec();
        gelu_backward_inplace(isa, x, &mut bi);
        let mut bx = x.to_vec();
        gelu_backward_over_input(isa, g, &mut bx);
        let (mut y3, mut dx) = (vec![0.0; n], x.to_vec());
        gelu_with_derivative_over_input(isa, &mut dx, &mut y3);
        let mut e = vec![0.0; xe.len()];
        exp(isa, xe, &mut e);
        let mut ei = xe.to_vec();
        exp_inplace(isa, &mut ei);
        vec![
            ("gelu", y),
            ("gelu_with_derivative.y", y2),
            ("gelu_with_derivative.d", d),
            ("gelu_backward", b),
            ("gelu_backward_inplace", bi),
            ("gelu_backward_over_input", bx),
            ("gelu_with_derivative_over_input.y", y3),
            ("gelu_with_derivative_over_input.d", dx),
            ("exp", e),
            ("exp_inplace", ei),
        ]
    }

    /// `|a - b|` in ulps at `b` (0 for equal values, equal infinities and two NaN).
    fn ulp_diff(a: f32, b: f32) -> f64 {
        if a == b || (a.is_nan() && b.is_nan()) {
            return 0.0;
        }
        ulps(a, f64::from(b))
    }

    #[test]
    fn every_isa_matches_the_portable_path_within_two_ulp() {
        let x = gelu_inputs();
        let g = grads(x.len());
        let xe = exp_inputs();
        let want = run_all(Isa::Portable, &x, &g, &xe);
        for isa in Isa::supported() {
            let got = run_all(isa, &x, &g, &xe);
            for ((name, got), (_, want)) in got.iter().zip(&want) {
                let mut worst = (0.0, 0);
                for (i, (&a, &b)) in got.iter().zip(want).enumerate() {
                    let d = ulp_diff(a, b);
                    if d > worst.0 {
                        worst = (d, i);
                    }
                }
                let (d, i) = worst;
                eprintln!("{isa:8} {name:24} max {d:.2} ulp from portable");
                let input = if name.starts_with("exp") { xe[i] } else { x[i] };
                assert!(d <= 2.0, "{isa} {name}({input:e}): {:e} vs portable {:e} ({d} ulp)", got[i], want[i]);
            }
        }
    }

    /// Odd lengths and offsets (so every tail length and misalignment occurs) give the values of
    /// the full run and touch nothing past the end of the output.
    #[test]
    fn tails_compute_the_same_values_and_write_nothing_past_the_end() {
        let x = gelu_inputs();
        let g = grads(x.len());
        let sentinel = 12345.0f32;
        for isa in Isa::supported() {
            let full = run_all(isa, &x, &g, &x);
            let full = |name: &str| &full.iter().find(|(n, _)| *n == name).unwrap().1;
            for len in (0..=40).chain([1000 + 3, 4099]) {
                for off in [0, 1, 5, 13] {
                    let r = off..off + len;
                    let (xs, gs) = (&x[r.clone()], &g[r.clone()]);
                    let check = |name: &str, buf: &[f32]| {
                        assert_eq!(buf[len], sentinel, "{isa} {name} len {len} wrote past the end");
                        for (i, (&a, &b)) in buf[..len].iter().zip(&full(name)[r.clone()]).enumerate() {
                            assert!(a.to_bits() == b.to_bits(), "{isa} {name} len {len} off {off} [{i}]: {a} vs {b}");
                        }
                    };
                    let mut y = vec![sentinel; len + 1];
                    gelu(isa, xs, &mut y[..len]);
                    check("gelu", &y);
                    let mut d = vec![sentinel; len + 1];
                    gelu_with_derivative(isa, xs, &mut y[..len], &mut d[..len]);
                    check("gelu_with_derivative.y", &y);
                    check("gelu_with_derivative.d", &d);
                    gelu_backward(isa, xs, gs, &mut y[..len]);
                    check("gelu_backward", &y);
                    y[..len].copy_from_slice(gs);
                    gelu_backward_inplace(isa, xs, &mut y[..len]);
                    check("gelu_backward", &y);
                    y[..len].copy_from_slice(xs);
                    gelu_backward_over_input(isa, gs, &mut y[..len]);
                    check("gelu_backward", &y);
                    d[..len].copy_from_slice(xs);
                    gelu_with_derivative_over_input(isa, &mut d[..len], &mut y[..len]);
                    check("gelu_with_derivative.y", &y);
                    check("gelu_with_derivative.d", &d);
                    exp(isa, xs, &mut y[..len]);
                    check("exp", &y);
                    y[..len].copy_from_slice(xs);
                    exp_inplace(isa, &mut y[..len]);
                    check("exp", &y);
                }
            }
        }
    }

    #[test]
    fn in_place_and_fused_variants_agree_bit_for_bit() {
        let x = gelu_inputs();
        let g = grads(x.len());
        for isa in Isa::supported() {
            let out = run_all(isa, &x, &g, &x);
            let get = |name: &str| &out.iter().find(|(n, _)| *n == name).unwrap().1;
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(get("gelu")), bits(get("gelu_with_derivative.y")), "{isa}");
            assert_eq!(bits(get("gelu_backward")), bits(get("gelu_backward_inplace")), "{isa}");
            assert_eq!(bits(get("gelu_backward")), bits(get("gelu_backward_over_input")), "{isa}");
            for part in ["y", "d"] {
                let (a, b) =
                    (format!("gelu_with_derivative.{part}"), format!("gelu_with_derivative_over_input.{part}"));
                assert_eq!(bits(get(&a)), bits(get(&b)), "{isa} {part}");
            }
            let gd: Vec<f32> = g.iter().zip(get("gelu_with_derivative.d")).map(|(g, d)| g * d).collect();
            assert_eq!(bits(get("gelu_backward")), bits(&gd), "{isa}");
            assert_eq!(bits(get("exp")), bits(get("exp_inplace")), "{isa}");
        }
    }

    /// The worst error of `f` over `xs` against `want` in ulps at `scale`: (ulps, input).
    fn worst(xs: &[f32], got: &[f32], want: impl Fn(f64) -> f64, scale: impl Fn(f64) -> f64) -> (f64, f32) {
        let mut w = (0.0, 0.0);
        for (&x, &y) in xs.iter().zip(got) {
            let e = ulps_at(y, want(f64::from(x)), scale(f64::from(x)));
            if e > w.0 || e.is_nan() {
                w = (e, x);
            }
        }
        w
    }

    /// The portable path against f64 (which the SIMD paths match within 2 ulp, above). Prints
    /// the measured maxima (`cargo test -p memfit-kernels --release math -- --nocapture`).
    #[test]
    fn the_portable_path_matches_f64_within_a_few_ulp() {
        let isa = Isa::Portable;
        let x: Vec<f32> = gelu_inputs().into_iter().filter(|v| !v.is_nan()).collect();
        let n = x.len();

        // The normal CDF behind all of it, and the erf it implies: erf(x/√2) = 2Φ(x) - 1.
        let phi: Vec<f32> = x
            .iter()
            .map(|&v| {
                // SAFETY: the portable lanes run on any CPU.
                let mut out = 0.0;
                unsafe { approx::normal_cdf(portable_lane(v)).store(&mut out) };
                out
            })
            .collect();
        let (e_cdf, at_cdf) = worst(&x, &phi, cdf_ref, cdf_ref);
        let erf_abs = x
            .iter()
            .zip(&phi)
            .map(|(&v, &p)| (2.0 * f64::from(p) - 1.0 - libm::erf(f64::from(v) / SQRT_2)).abs())
            .fold(0.0, f64::max);

        let mut y = vec![0.0; n];
        gelu(isa, &x, &mut y);
        let (e_gelu, at_gelu) = worst(&x, &y, gelu_ref, gelu_ref);
        let mut d = vec![0.0; n];
        gelu_with_derivative(isa, &x, &mut y, &mut d);
        let (e_der, at_der) = worst(&x, &d, derivative_ref, derivative_scale);
        // Plain relative error where the derivative is at least half the size of its terms
        // (everywhere but around its root near -0.75).
        let far: Vec<usize> = (0..n)
            .filter(|&i| derivative_ref(f64::from(x[i])).abs() >= 0.5 * derivative_scale(f64::from(x[i])))
            .collect();
        let (xf, df): (Vec<f32>, Vec<f32>) = far.iter().map(|&i| (x[i], d[i])).unzip();
        let (e_der_rel, at_der_rel) = worst(&xf, &df, derivative_ref, derivative_ref);

        let xe: Vec<f32> = exp_inputs().into_iter().filter(|v| !v.is_nan()).collect();
        let mut e = vec![0.0; xe.len()];
        exp(isa, &xe, &mut e);
        let (e_exp, at_exp) = worst(&xe, &e, f64::exp, f64::exp);
        // Against the standard library's expf as well.
        let e_std = xe.iter().zip(&e).map(|(&v, &y)| ulp_diff(y, v.exp())).fold(0.0, f64::max);

        eprintln!("normal cdf   max {e_cdf:.3} ulp (at {at_cdf:e}); implied erf max abs error {erf_abs:.2e}");
        eprintln!("gelu         max {e_gelu:.3} ulp (at {at_gelu:e})");
        eprintln!("gelu'        max {e_der:.3} ulp of |Φ|+|xφ| (at {at_der:e}); {e_der_rel:.3} ulp relative where |gelu'| >= (|Φ|+|xφ|)/2 (at {at_der_rel:e})");
        eprintln!("exp          max {e_exp:.3} ulp (at {at_exp:e}); max {e_std:.3} ulp from f32::exp");
        assert!(e_cdf <= 2.5, "normal cdf: {e_cdf} ulp at {at_cdf}");
        assert!(erf_abs <= 2e-7, "erf: {erf_abs}");
        assert!(e_gelu <= 3.0, "gelu: {e_gelu} ulp at {at_gelu}");
        assert!(e_der <= 3.0, "gelu': {e_der} ulp at {at_der}");
        assert!(e_der_rel <= 4.0, "gelu' relative: {e_der_rel} ulp at {at_der_rel}");
        assert!(e_exp <= 1.5, "exp: {e_exp} ulp at {at_exp}");
        assert!(e_std <= 1.5, "exp vs f32::exp: {e_std} ulp");
    }

    fn portable_lane(v: f32) -> portable::F32x1 {
        // SAFETY: the portable lanes run on any CPU.
        unsafe { portable::F32x1::splat(v) }
    }

    #[test]
    fn special_values() {
        let nan = f32::NAN;
        let inf = f32::INFINITY;
        for isa in Isa::supported() {
            let x = [0.0, -0.0, inf, -inf, nan, 10.0, 100.0, -100.0, 1e30, -1e30, f32::MAX, f32::MIN];
            let mut y = [0.0; 12];
            let mut d = [0.0; 12];
            gelu_with_derivative(isa, &x, &mut y, &mut d);
            assert_eq!(y[0].to_bits(), 0f32.to_bits(), "{isa} gelu(0)");
            assert_eq!(y[1].to_bits(), (-0f32).to_bits(), "{isa} gelu(-0)");
            assert_eq!(y[2], inf, "{isa} gelu(inf)");
            assert_eq!(y[3], 0.0, "{isa} gelu(-inf)");
            assert!(y[4].is_nan(), "{isa} gelu(nan)");
            assert_eq!(y[5], 10.0, "{isa} gelu(10)");
            assert_eq!(y[6], 100.0, "{isa} gelu(100)");
            assert_eq!(y[7], 0.0, "{isa} gelu(-100)");
            assert_eq!(y[8], 1e30, "{isa} gelu(1e30)");
            assert_eq!(y[9], 0.0, "{isa} gelu(-1e30)");
            assert_eq!(y[10], f32::MAX, "{isa} gelu(MAX)");
            assert_eq!(y[11], 0.0, "{isa} gelu(MIN)");
            assert_eq!(d[0], 0.5, "{isa} gelu'(0)");
            assert_eq!(d[1], 0.5, "{isa} gelu'(-0)");
            assert_eq!(d[2], 1.0, "{isa} gelu'(inf)");
            assert_eq!(d[3], 0.0, "{isa} gelu'(-inf)");
            assert!(d[4].is_nan(), "{isa} gelu'(nan)");
            assert_eq!(&d[5..7], &[1.0, 1.0], "{isa} gelu'(10, 100)");
            assert_eq!(d[7], 0.0, "{isa} gelu'(-100)");
            assert_eq!(&d[8..], &[1.0, 0.0, 1.0, 0.0], "{isa} gelu'(±1e30, ±MAX)");
            // gelu(-10) = -7.6e-23: the far tail keeps its relative accuracy.
            let mut t = [0.0];
            gelu(isa, &[-10.0], &mut t);
            assert!(ulps(t[0], gelu_ref(-10.0)) <= 2.0, "{isa} gelu(-10) = {:e}", t[0]);

            let mut b = [0.0; 12];
            gelu_backward(isa, &x, &[2.0; 12], &mut b);
            let want: Vec<f32> = d.iter().map(|d| 2.0 * d).collect();
            assert_eq!(format!("{b:?}"), format!("{want:?}"), "{isa} gelu_backward");

            let x = [0.0, -0.0, inf, -inf, nan, 1.0, 88.722_83, 88.722_84, 89.0, -103.98, -104.0, -200.0, 1e30, -1e30];
            let mut e = [0.0; 14];
            exp(isa, &x, &mut e);
            assert_eq!(&e[..4], &[1.0, 1.0, inf, 0.0], "{isa} exp(±0, ±inf)");
            assert!(e[4].is_nan(), "{isa} exp(nan)");
            assert!(ulps(e[5], 1f64.exp()) <= 1.0, "{isa} exp(1) = {}", e[5]);
            let want = f64::from(88.722_83f32).exp();
            assert!(e[6].is_finite() && ulps(e[6], want) <= 1.0, "{isa} exp(88.72283) = {:e}", e[6]);
            assert_eq!(&e[7..], &[inf, inf, 0.0, 0.0, 0.0, inf, 0.0], "{isa} exp overflow/underflow");
            // The subnormal range: within one unit of the smallest subnormal.
            for v in [-87.5f32, -90.0, -95.0, -100.0, -103.0, -103.9] {
                exp(isa, &[v], &mut e[..1]);
                assert!(ulps(e[0], f64::from(v).exp()) <= 1.0, "{isa} exp({v}) = {:e}", e[0]);
                assert!(e[0] > 0.0 && e[0] < f32::MIN_POSITIVE, "{isa} exp({v}) = {:e}", e[0]);
            }
        }
    }

    /// torch.nn.functional.gelu (float32) at a few points. Where torch itself is off by more than
    /// an ulp (it forms 1 + erf(x/√2) in f32, which cancels for negative x: -11.8 ulp at -3,
    /// -2.1 ulp at -1 from the exact value) the check allows torch's own error on top of 2 ulp;
    /// everywhere it also holds against the f64 value.
    #[test]
    fn gelu_matches_torch() {
        // (x, torch, torch's own error in ulp)
        let golden: [(f32, f32, f64); 7] = [
            (-3.0, -0.004_049_688_6, 12.0),
            (-1.0, -0.158_655_29, 2.2),
            (-0.5, -0.154_268_77, 0.0),
            (0.5, 0.345_731_23, 0.0),
            (1.0, 0.841_344_7, 0.0),
            (2.0, 1.954_499_7, 0.0),
            (3.0, 2.995_950_2, 0.0),
        ];
        let x: Vec<f32> = golden.iter().map(|g| g.0).collect();
        for isa in Isa::supported() {
            let mut y = vec![0.0; x.len()];
            gelu(isa, &x, &mut y);
            for (&(x, torch, torch_err), &got) in golden.iter().zip(&y) {
                let from_torch = ulp_diff(got, torch);
                let from_exact = ulps(got, gelu_ref(f64::from(x)));
                eprintln!(
                    "{isa:8} gelu({x:4}) = {got:e}: {from_torch:.2} ulp from torch, {from_exact:.2} ulp from exact"
                );
                assert!(from_torch <= 2.0 + torch_err, "{isa} gelu({x}) = {got:e} vs torch {torch:e}");
                assert!(from_exact <= 2.0, "{isa} gelu({x}) = {got:e}");
            }
        }
    }

    /// Every f32 (all 2^32 bit patterns): each SIMD path within 2 ulp of the portable one, and
    /// the portable one against f64 on every 17th pattern. Minutes of work, so it runs only when
    /// asked: `MEMFIT_EXHAUSTIVE=1 cargo test -p memfit-kernels --release math::tests::exhaustive -- --nocapture`.
    #[test]
    fn exhaustive() {
        if std::env::var_os("MEMFIT_EXHAUSTIVE").is_none() {
            println!("SKIPPED: set MEMFIT_EXHAUSTIVE=1 to check all 2^32 inputs");
            return;
        }
        const CHUNK: u64 = 1 << 20;
        let chunks: Vec<u64> = (0..(1u64 << 32) / CHUNK).collect();
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        // Per thread: [simd gelu, simd d, simd exp] max ulp from portable, then f64 maxima
        // [gelu, d (scaled), exp] with their inputs.
        type Maxima = ([f64; 3], [(f64, f32); 3]);
        let results: Vec<Maxima> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..threads)
                .map(|t| {
                    let chunks = &chunks;
                    scope.spawn(move || {
                        let mut simd = [0.0f64; 3];
                        let mut refs = [(0.0f64, 0.0f32); 3];
                        let n = CHUNK as usize;
                        let (mut y, mut d, mut e) = (vec![0.0; n], vec![0.0; n], vec![0.0; n]);
                        let (mut ys, mut ds, mut es) = (vec![0.0; n], vec![0.0; n], vec![0.0; n]);
                        for &c in chunks.iter().skip(t).step_by(threads) {
                            let x: Vec<f32> = (c * CHUNK..(c + 1) * CHUNK).map(|b| f32::from_bits(b as u32)).collect();
                            gelu_with_derivative(Isa::Portable, &x, &mut y, &mut d);
                            exp(Isa::Portable, &x, &mut e);
                            for isa in Isa::supported().into_iter().filter(|&i| i != Isa::Portable) {
                                gelu_with_derivative(isa, &x, &mut ys, &mut ds);
                                exp(isa, &x, &mut es);
                                for i in 0..n {
                                    for (k, (a, b)) in
                                        [(ys[i], y[i]), (ds[i], d[i]), (es[i], e[i])].into_iter().enumerate()
                                    {
                                        let diff = ulp_diff(a, b);
                                        assert!(diff <= 2.0, "{isa} [{k}] at {:e}: {a:e} vs {b:e}", x[i]);
                                        simd[k] = simd[k].max(diff);
                                    }
                                }
                            }
                            for i in (0..n).filter(|i| (c * CHUNK + *i as u64).is_multiple_of(17)) {
                                let v = x[i];
                                if v.is_nan() {
                                    continue;
                                }
                                let w = f64::from(v);
                                let errs = [
                                    ulps(y[i], gelu_ref(w)),
                                    ulps_at(d[i], derivative_ref(w), derivative_scale(w)),
                                    ulps(e[i], w.exp()),
                                ];
                                for (k, err) in errs.into_iter().enumerate() {
                                    if err > refs[k].0 {
                                        refs[k] = (err, v);
                                    }
                                }
                            }
                        }
                        (simd, refs)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let mut simd = [0.0f64; 3];
        let mut refs = [(0.0f64, 0.0f32); 3];
        for (s, r) in results {
            for k in 0..3 {
                simd[k] = simd[k].max(s[k]);
                if r[k].0 > refs[k].0 {
                    refs[k] = r[k];
                }
            }
        }
        eprintln!(
            "SIMD vs portable, max ulp over all f32: gelu {:.2}, gelu' {:.2}, exp {:.2}",
            simd[0], simd[1], simd[2]
        );
        eprintln!(
            "portable vs f64 (every 17th f32): gelu {:?}, gelu' (ulp of |Φ|+|xφ|) {:?}, exp {:?}",
            refs[0], refs[1], refs[2]
        );
        assert!(refs[0].0 <= 3.0 && refs[1].0 <= 3.0 && refs[2].0 <= 1.5, "{refs:?}");
    }

    #[test]
    #[should_panic(expected = "differ in length")]
    fn mismatched_lengths_panic() {
        gelu(Isa::Portable, &[1.0, 2.0], &mut [0.0]);
    }
}
