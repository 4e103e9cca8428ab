//! Elements per second of the element-wise math kernels (`memfit_kernels::math`) per instruction
//! set, on one thread over a 1M-element slice (median of 21 runs), next to the scalar code they
//! replace (`0.5 x (1 + erff(x/√2))` with libm, and `f32::exp`):
//! `cargo run --release -p memfit-kernels --example math_bench [--isa NAME] [--len N]`.

use memfit_kernels::math;
use memfit_kernels::Isa;
use std::f32::consts::FRAC_1_SQRT_2;
use std::hint::black_box;
use std::time::Instant;

const RUNS: usize = 21;

/// Elements per second: `len` over the median of `RUNS` calls of `run`, which returns the seconds
/// its kernel took (so it can restore, untimed, the buffer an in-place kernel overwrites).
fn rate(len: usize, mut run: impl FnMut() -> f64) -> f64 {
    for _ in 0..3 {
        run();
    }
    let mut times: Vec<f64> = (0..RUNS).map(|_| run()).collect();
    times.sort_by(f64::total_cmp);
    len as f64 / times[RUNS / 2]
}

/// The seconds `f` takes.
fn timed(f: impl FnOnce()) -> f64 {
    let t0 = Instant::now();
    f();
    t0.elapsed().as_secs_f64()
}

fn print(what: &str, name: &str, rate: f64) {
    println!("{what:9} {name:24} {:8.1} Melem/s", rate / 1e6);
}

/// Values spread over [-6, 6] (GELU inputs and gradients; exp's inputs too, so nothing overflows).
fn values(len: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..len)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 12.0 - 6.0
        })
        .collect()
}

fn main() {
    let mut args = std::env::args().skip(1);
    let (mut only, mut len) = (None, 1 << 20);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--isa" => only = args.next().and_then(|n| Isa::parse(&n)),
            "--len" => len = args.next().and_then(|n| n.parse().ok()).expect("--len N"),
            _ => panic!("unknown argument {a:?}"),
        }
    }
    let x = values(len, 1);
    let g = values(len, 2);
    let (mut y, mut d, mut buf) = (vec![0.0f32; len], vec![0.0f32; len], vec![0.0f32; len]);
    println!("{len} elements, one thread, median of {RUNS} runs");

    for isa in Isa::supported().into_iter().filter(|i| only.is_none_or(|o| o == *i)) {
        let isa_name = isa.name();
        print(isa_name, "gelu", rate(len, || timed(|| math::gelu(isa, black_box(&x), black_box(&mut y)))));
        print(
            isa_name,
            "gelu_with_derivative",
            rate(len, || {
                timed(|| math::gelu_with_derivative(isa, black_box(&x), black_box(&mut y), black_box(&mut d)))
            }),
        );
        print(
            isa_name,
            "gelu_backward",
            rate(len, || timed(|| math::gelu_backward(isa, black_box(&x), &g, black_box(&mut y)))),
        );
        print(
            isa_name,
            "gelu_backward_inplace",
            rate(len, || {
                buf.copy_from_slice(&g);
                timed(|| math::gelu_backward_inplace(isa, black_box(&x), black_box(&mut buf)))
            }),
        );
        print(isa_name, "exp", rate(len, || timed(|| math::exp(isa, black_box(&x), black_box(&mut y)))));
        print(
            isa_name,
            "exp_inplace",
            rate(len, || {
                buf.copy_from_slice(&x);
                timed(|| math::exp_inplace(isa, black_box(&mut buf)))
            }),
        );
    }

    // The scalar code the kernels replace (as memfit-tensor's elementwise ops compute it).
    let scalar = "scalar";
    print(
        scalar,
        "gelu (libm erff)",
        rate(len, || {
            timed(|| {
                for (y, &x) in black_box(&mut y).iter_mut().zip(black_box(&x)) {
                    *y = 0.5 * x * (1.0 + libm::erff(x * FRAC_1_SQRT_2));
                }
            })
        }),
    );
    print(
        scalar,
        "gelu_backward (erff+exp)",
        rate(len, || {
            timed(|| {
                for ((o, &x), &g) in black_box(&mut y).iter_mut().zip(black_box(&x)).zip(&g) {
                    let cdf = 0.5 * (1.0 + libm::erff(x * FRAC_1_SQRT_2));
                    let pdf = (-0.5 * x * x).exp() * 0.398_942_3;
                    *o = g * (cdf + x * pdf);
                }
            })
        }),
    );
    print(
        scalar,
        "exp (f32::exp)",
        rate(len, || {
            timed(|| {
                for (y, &x) in black_box(&mut y).iter_mut().zip(black_box(&x)) {
                    *y = x.exp();
                }
            })
        }),
    );
}
