//! GFLOP/s of memfit's GEMM for the products of the bench cases, per instruction set:
//! `cargo run --release -p memfit-kernels --example gemm_bench [threads]`. The same cases as
//! `tools/torch_gemm.py` (`--isa NAME` runs one level only, `--case TEXT` the cases whose name
//! contains TEXT; `--bf16`: the bf16 product at each of its levels this CPU has instead).

use memfit_kernels::gemm::{gemm, MatMut, MatRef, Start};
use memfit_kernels::gemm_bf16::{gemm_rounded, Bf16Level};
use memfit_kernels::Isa;
use std::time::Instant;

/// (name, m, n, k, layout): C[m,n] = A[m,k] B[k,n]; "NT": B is the transpose of a [n,k] matrix,
/// "TN": A is the transpose of a [k,m] matrix.
pub const CASES: &[(&str, usize, usize, usize, &str)] = &[
    ("mlp fwd 784->1024", 256, 1024, 784, "NT"),
    ("mlp fwd 1024->1024", 256, 1024, 1024, "NT"),
    ("mlp dW", 1024, 784, 256, "TN"),
    ("mlp dX", 256, 784, 1024, "NN"),
    ("gpt qkv fwd", 4096, 768, 256, "NT"),
    ("gpt fc1 fwd", 4096, 1024, 256, "NT"),
    ("gpt fc2 fwd", 4096, 256, 1024, "NT"),
    ("gpt dX fc1", 4096, 256, 1024, "NN"),
    ("gpt dW fc1", 1024, 256, 4096, "TN"),
    ("gpt dW fc2", 256, 1024, 4096, "TN"),
    ("gpt ln dX block attn", 512, 256, 768, "NN"),
    ("gpt ln dX block mlp", 512, 256, 1024, "NN"),
    ("gpt ln dW block mlp", 1024, 256, 512, "TN"),
    ("sq 1024", 1024, 1024, 1024, "NN"),
];

fn main() {
    let mut args = std::env::args().skip(1);
    let mut threads = 2;
    let mut only = None;
    let mut case = String::new();
    let mut bf16 = false;
    while let Some(a) = args.next() {
        if a == "--bf16" {
            bf16 = true;
        } else if a == "--isa" {
            only = args.next().and_then(|n| Isa::parse(&n));
        } else if a == "--case" {
            case = args.next().unwrap_or_default();
        } else {
            threads = a.parse().expect("threads");
        }
    }
    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("pool");
    // (name, the f32 level, the bf16 level) of each level to run.
    let levels: Vec<(&str, Isa, Option<Bf16Level>)> = if bf16 {
        Bf16Level::supported().into_iter().map(|l| (l.name(), Isa::Portable, Some(l))).collect()
    } else {
        Isa::supported().into_iter().filter(|i| only.is_none_or(|o| o == *i)).map(|i| (i.name(), i, None)).collect()
    };
    for (level, isa, bf16_level) in levels {
        for &(name, m, n, k, lay) in CASES.iter().filter(|c| c.0.contains(&case)) {
            let a = vec![0.5f32; m * k];
            let b = vec![0.25f32; k * n];
            let mut c = vec![0.0f32; m * n];
            let (ars, acs) = if lay == "TN" { (1, m) } else { (k, 1) };
            let (brs, bcs) = if lay == "NT" { (1, k) } else { (n, 1) };
            // SAFETY: the buffers hold exactly the shapes and strides passed.
            let run = |c: &mut Vec<f32>| unsafe {
                let (cm, am) = (
                    MatMut { ptr: c.as_mut_ptr(), rs: n as isize },
                    MatRef { ptr: a.as_ptr(), rs: ars as isize, cs: acs as isize },
                );
                let bm = MatRef { ptr: b.as_ptr(), rs: brs as isize, cs: bcs as isize };
                match bf16_level {
                    Some(l) => gemm_rounded(l, m, n, k, cm, Start::Zero, am, bm, threads),
                    None => gemm(isa, m, n, k, cm, Start::Zero, am, bm, threads),
                }
            };
            let mut times = pool.install(|| {
                for _ in 0..3 {
                    run(&mut c);
                }
                (0..15)
                    .map(|_| {
                        let t0 = Instant::now();
                        let mut reps = 0;
                        loop {
                            run(&mut c);
                            reps += 1;
                            let t = t0.elapsed().as_secs_f64();
                            if t > 0.02 {
                                break t / reps as f64;
                            }
                        }
                    })
                    .collect::<Vec<_>>()
            });
            assert_eq!(c[0], 0.125 * k as f32);
            times.sort_by(f64::total_cmp);
            let t = times[times.len() / 2];
            println!("{level:11} {name:22} {m:5} {n:5} {k:5} {lay} {:7.1} GFLOP/s", 2.0 * (m * n * k) as f64 / t / 1e9);
        }
    }
}
