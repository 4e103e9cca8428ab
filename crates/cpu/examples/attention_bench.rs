//! Milliseconds of the fused causal self-attention kernels on the GPT bench case's shape (batch 32,
//! 4 heads, T = 128, head size 64, q/k/v packed in one [B, T, 3E] projection as the model passes
//! them), forward or backward, on 2 threads: the median of 50 calls after 10 unmeasured ones.
//! `cargo run --release -p memfit-cpu --example attention_bench [bwd]`; `MEMFIT_ISA` picks the
//! instruction set. The attention op's share of a GPT step is in `memfit profile`'s trace.

use memfit_cpu::attention::{
    attention, attention_backward, attention_delta, AttnAddr, AttnDims, AttnLayouts, AttnProblem,
};
use memfit_cpu::dtype::DType;
use memfit_cpu::layout::Layout;
use memfit_cpu::View;
use std::time::Instant;

/// `n` values in [-0.5, 0.5), spread by the multiplier `mul`.
fn values(n: usize, mul: usize) -> Vec<f32> {
    (0..n).map(|i| (i * mul % 1000) as f32 / 1000.0 - 0.5).collect()
}

/// A view of all of `v` as a contiguous f32 tensor of `layout`'s shape.
///
/// # Safety
/// `v` must hold `layout`'s elements and outlive the view.
unsafe fn view<'a>(v: &mut [f32], layout: &'a Layout) -> View<'a> {
    View::new(v.as_mut_ptr() as *mut u8, v.len() * 4, DType::F32, layout)
}

fn main() {
    let backward = std::env::args().any(|a| a == "bwd");
    let (b, heads, t, dh) = (32usize, 4usize, 128usize, 64usize);
    let e = heads * dh;
    let mut qkv = values(b * t * 3 * e, 7919);
    let mut out = vec![0f32; b * t * e];
    let mut lse = vec![0f32; b * heads * t];
    let mut delta = vec![0f32; b * heads * t];
    let mut grad_out = values(b * t * e, 104_729);
    let mut grad_qkv = vec![0f32; b * t * 3 * e];
    let part = |i: usize| AttnAddr { offset: i * e, batch_stride: t * 3 * e, head_stride: dh, row_stride: 3 * e };
    let out_addr = AttnAddr { offset: 0, batch_stride: t * e, head_stride: dh, row_stride: e };
    let lay = AttnLayouts { q: part(0), k: part(1), v: part(2), out: out_addr };
    let dims = AttnDims { bh: b * heads, heads, tq: t, tk: t, d: dh, dv: dh };
    let pb = AttnProblem {
        dims,
        lay,
        scale: 1.0 / (dh as f64).sqrt(),
        causal: true,
        full: vec![b, heads, t, t],
        products: memfit_cpu::gemm::Products::F32,
    };
    let (l_qkv, l_out, l_lse) =
        (Layout::contiguous(&[b, t, 3 * e]), Layout::contiguous(&[b, t, e]), Layout::contiguous(&[b * heads, t]));
    let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().expect("thread pool");
    let mut times = Vec::new();
    pool.install(|| {
        // The forward's log-sum-exp, which backward reads.
        // SAFETY: as below.
        unsafe {
            let (q, o, l) = (view(&mut qkv, &l_qkv), view(&mut out, &l_out), view(&mut lse, &l_lse));
            attention(q, q, q, None, &pb, o, Some(l), None).expect("forward");
        }
        for call in 0..60 {
            let t0 = Instant::now();
            // SAFETY: every buffer holds its layout's elements and outlives its views; the
            // gradient is written through one view passed for q, k and v, as the packed op does.
            unsafe {
                let (q, o, l) = (view(&mut qkv, &l_qkv), view(&mut out, &l_out), view(&mut lse, &l_lse));
                if backward {
                    let (g, gq, d) =
                        (view(&mut grad_out, &l_out), view(&mut grad_qkv, &l_qkv), view(&mut delta, &l_lse));
                    attention_delta(o, g, &pb, d).expect("D");
                    attention_backward(q, q, q, None, l, &pb, g, Some(d), Some(gq), Some(gq), Some(gq), None)
                        .expect("backward");
                } else {
                    attention(q, q, q, None, &pb, o, Some(l), None).expect("forward");
                }
            }
            if call >= 10 {
                times.push(t0.elapsed().as_secs_f64());
            }
        }
    });
    times.sort_by(f64::total_cmp);
    let phase = if backward { "backward" } else { "forward" };
    println!("attention {phase}: median {:.3} ms", times[times.len() / 2] * 1e3);
}
