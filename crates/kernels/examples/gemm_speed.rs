//! The speed of one product per kernel: f32 (`memfit_kernels::gemm`) at the process's instruction
//! set, and the bf16 product (`gemm_bf16`) at every level this CPU has, on a GPT step's shapes
//! (rows = batch 32 x context 128). Medians of 7 runs, on all of rayon's threads.
//!
//! `cargo run --release -p memfit-kernels --example gemm_speed [M N K ...]`

use memfit_kernels::gemm::{gemm, MatMut, MatRef, Start};
use memfit_kernels::gemm_bf16::{gemm_bf16, Bf16Level};
use memfit_kernels::Isa;
use std::time::Instant;

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

fn main() {
    let args: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let shapes: Vec<(usize, usize, usize)> = if args.len() >= 3 {
        args.chunks(3).filter(|c| c.len() == 3).map(|c| (c[0], c[1], c[2])).collect()
    } else {
        // The GPT's products: QKV, the MLP's two, the head; and a square one.
        vec![(4096, 768, 256), (4096, 1024, 256), (4096, 256, 1024), (4096, 96, 256), (1024, 1024, 1024)]
    };
    let threads = rayon::current_num_threads();
    let isa = Isa::active();
    println!("{threads} threads; f32 at {}; bf16 levels {:?}", isa.name(), Bf16Level::supported());
    for (m, n, k) in shapes {
        let a: Vec<f32> = (0..m * k).map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5).collect();
        let b: Vec<f32> = (0..k * n).map(|i| ((i * 104_729) % 1000) as f32 / 1000.0 - 0.5).collect();
        let mut c = vec![0f32; m * n];
        let (am, bm) =
            (MatRef { ptr: a.as_ptr(), rs: k as isize, cs: 1 }, MatRef { ptr: b.as_ptr(), rs: n as isize, cs: 1 });
        let flops = 2.0 * (m * n * k) as f64;
        let time = |f: &mut dyn FnMut()| {
            f();
            median(
                (0..7)
                    .map(|_| {
                        let t = Instant::now();
                        f();
                        t.elapsed().as_secs_f64()
                    })
                    .collect(),
            )
        };
        let cm = MatMut { ptr: c.as_mut_ptr(), rs: n as isize };
        // SAFETY: row-major operands and output of these shapes.
        let f32_s = time(&mut || unsafe { gemm(isa, m, n, k, cm, Start::Zero, am, bm, threads) });
        let mut line = format!("m {m:5} n {n:5} k {k:5}: f32 {:7.1} GFLOP/s", flops / f32_s / 1e9);
        for level in Bf16Level::supported() {
            // SAFETY: as above.
            let s = time(&mut || unsafe { gemm_bf16(level, m, n, k, cm, Start::Zero, am, bm, threads) });
            line.push_str(&format!("  bf16 {} {:7.1} ({:.2}x f32's time)", level.name(), flops / s / 1e9, s / f32_s));
        }
        println!("{line}");
    }
}
