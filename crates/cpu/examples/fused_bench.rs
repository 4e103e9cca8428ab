//! Milliseconds of the fused backward kernels of one GPT block on the bench case's shape (4096
//! rows: batch 32 x T 128, d 256), on 2 threads: `gelu` is `gelu_linear_backward` of the MLP's
//! second layer (in 1024, out 256), `ln1` and `ln2` are `layer_norm_linear_backward` of the
//! attention's (out 768) and the MLP's (out 1024) first layer, every gradient wanted and the input
//! gradient written over the input, as the model runs them. The median of 32 calls after 8
//! unmeasured ones (each restores the input first, outside the timing).
//! `cargo run --release -p memfit-cpu --example fused_bench -- gelu|ln1|ln2`; `MEMFIT_ISA` picks
//! the instruction set. These ops are about 60% of a GPT step (`memfit profile --model gpt`), almost
//! all GEMM: they show what a change to their non-GEMM work is worth, within about 1%, where the
//! whole step varies by far more on a shared host.

use memfit_cpu::dtype::DType;
use memfit_cpu::kernels;
use memfit_cpu::layout::Layout;
use memfit_cpu::View;
use std::time::Instant;

/// `n` values in [-0.5, 0.5), spread by the multiplier `mul`.
fn values(n: usize, mul: usize) -> Vec<f32> {
    (0..n).map(|i| (i * mul % 1000) as f32 / 1000.0 - 0.5).collect()
}

/// A view of all of `v` as a contiguous tensor of `layout`'s shape and `dtype`.
///
/// # Safety
/// `v` must hold `layout`'s elements of `dtype` and outlive the view.
unsafe fn view<'a, T>(v: &mut [T], dtype: DType, layout: &'a Layout) -> View<'a> {
    View::new(v.as_mut_ptr() as *mut u8, std::mem::size_of_val(v), dtype, layout)
}

const ROWS: usize = 4096;

/// Times `call` (after `reset`, untimed) and returns the median in milliseconds.
fn median_ms(mut reset: impl FnMut(), mut call: impl FnMut()) -> f64 {
    let mut times = Vec::new();
    for i in 0..40 {
        reset();
        let t0 = Instant::now();
        call();
        if i >= 8 {
            times.push(t0.elapsed().as_secs_f64() * 1e3);
        }
    }
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}

fn gelu() -> f64 {
    let (inf, outf) = (1024, 256);
    let x0 = values(ROWS * inf, 7919);
    let (mut x, mut w, mut g) = (x0.clone(), values(outf * inf, 31), values(ROWS * outf, 104_729));
    let (mut gw, mut gb) = (vec![0f32; outf * inf], vec![0f32; outf]);
    let block = ROWS.min(kernels::GELU_ROWS);
    let stride = kernels::gelu_scratch_stride(inf, block);
    let mut scratch = vec![0f32; block * stride];
    let (lx, lw, lg) =
        (Layout::contiguous(&[ROWS, inf]), Layout::contiguous(&[outf, inf]), Layout::contiguous(&[ROWS, outf]));
    let (lb, ls) = (Layout::contiguous(&[outf]), Layout::contiguous(&[block, stride]));
    let xp = x.as_mut_ptr();
    median_ms(
        // SAFETY: x is reached through `xp` only, and its views live inside the call only.
        || unsafe { std::slice::from_raw_parts_mut(xp, x0.len()) }.copy_from_slice(&x0),
        // SAFETY: every buffer holds its layout's f32 elements and outlives its views; the input
        // gradient is written over x through a second view of it, as the op does in place.
        || unsafe {
            let (x_in, x_grad) = (
                view(std::slice::from_raw_parts_mut(xp, ROWS * inf), DType::F32, &lx),
                view(std::slice::from_raw_parts_mut(xp, ROWS * inf), DType::F32, &lx),
            );
            let (w, g) = (view(&mut w, DType::F32, &lw), view(&mut g, DType::F32, &lg));
            let (gw, gb) = (view(&mut gw, DType::F32, &lw), view(&mut gb, DType::F32, &lb));
            kernels::gelu_linear_backward(
                x_in,
                w,
                g,
                Some(x_grad),
                Some(gw),
                Some(gb),
                view(&mut scratch, DType::F32, &ls),
                memfit_cpu::gemm::Products::F32,
            )
            .expect("gelu_linear_backward");
        },
    )
}

fn layer_norm(outf: usize) -> f64 {
    let d = 256;
    let x0 = values(ROWS * d, 7919);
    let (mut x, mut lw, mut lb, mut w) = (x0.clone(), values(d, 3), values(d, 5), values(outf * d, 31));
    let (mut mean, mut g) = (values(ROWS, 11), values(ROWS * outf, 104_729));
    let mut rstd: Vec<f32> = values(ROWS, 13).iter().map(|v| 1.0 + v.abs()).collect();
    let (mut glw, mut glb, mut gw, mut gb) = (vec![0f32; d], vec![0f32; d], vec![0f32; outf * d], vec![0f32; outf]);
    let mut scratch = vec![0f32; ROWS.min(kernels::LN_ROWS) * d];
    let mut sums = vec![0f64; 2 * d];
    let (lx, ld, lw2) = (Layout::contiguous(&[ROWS, d]), Layout::contiguous(&[d]), Layout::contiguous(&[outf, d]));
    let (lr, lg, lo) = (Layout::contiguous(&[ROWS]), Layout::contiguous(&[ROWS, outf]), Layout::contiguous(&[outf]));
    let (ls, lsum) = (Layout::contiguous(&[scratch.len()]), Layout::contiguous(&[2 * d]));
    let xp = x.as_mut_ptr();
    median_ms(
        // SAFETY: x is reached through `xp` only, and its views live inside the call only.
        || unsafe { std::slice::from_raw_parts_mut(xp, x0.len()) }.copy_from_slice(&x0),
        // SAFETY: every buffer holds its layout's elements of the dtype given and outlives its
        // views; the input gradient is written over x through a second view, as the op does.
        || unsafe {
            let f = DType::F32;
            let (x_in, x_grad) = (
                view(std::slice::from_raw_parts_mut(xp, ROWS * d), f, &lx),
                view(std::slice::from_raw_parts_mut(xp, ROWS * d), f, &lx),
            );
            let (lw, lb, w) = (view(&mut lw, f, &ld), view(&mut lb, f, &ld), view(&mut w, f, &lw2));
            let (mean, rstd, g) = (view(&mut mean, f, &lr), view(&mut rstd, f, &lr), view(&mut g, f, &lg));
            let (glw, glb) = (view(&mut glw, f, &ld), view(&mut glb, f, &ld));
            let (gw, gb) = (view(&mut gw, f, &lw2), view(&mut gb, f, &lo));
            let (scratch, sums) = (view(&mut scratch, f, &ls), view(&mut sums, DType::F64, &lsum));
            let (gx, glw, glb, gw, gb) = (Some(x_grad), Some(glw), Some(glb), Some(gw), Some(gb));
            kernels::layer_norm_linear_backward(
                x_in,
                lw,
                lb,
                w,
                mean,
                rstd,
                g,
                gx,
                glw,
                glb,
                gw,
                gb,
                scratch,
                Some(sums),
                memfit_cpu::gemm::Products::F32,
            )
            .expect("layer_norm_linear_backward");
        },
    )
}

fn main() {
    let which = std::env::args().nth(1).unwrap_or_else(|| "gelu".into());
    let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().expect("thread pool");
    let ms = match which.as_str() {
        "gelu" => pool.install(gelu),
        "ln1" => pool.install(|| layer_norm(768)),
        "ln2" => pool.install(|| layer_norm(1024)),
        other => {
            eprintln!("fused_bench: unknown op {other:?}: expected gelu, ln1 or ln2");
            std::process::exit(2);
        }
    };
    println!("{which} backward: median {ms:.3} ms");
}
