//! Kernels that write (or read) through raw pointers sized from their parameters refuse a buffer
//! shorter than those parameters need, with an error naming it, instead of running past its end.
//! Each case runs its kernel once with every buffer exactly as long as needed (it must succeed), then
//! once per checked buffer with that buffer one element short (it must fail, naming the buffer).

use memfit_cpu::attention::{AttnAddr, AttnDims, AttnLayouts, AttnProblem};
use memfit_cpu::dtype::DType;
use memfit_cpu::gemm::Products::F32;
use memfit_cpu::kernels;
use memfit_cpu::layout::Layout;
use memfit_cpu::pool::{Avg, PoolGeom};
use memfit_cpu::{Error, Result, View};

/// One kernel call: the buffers it gets (dtype and shape, zero-filled), the call, and which buffers
/// to shorten (index, the shape it gets one element short, words its error must contain).
struct Case {
    name: &'static str,
    buffers: Vec<(DType, Vec<usize>)>,
    call: Box<dyn Fn(&[View<'_>]) -> Result<()>>,
    shortened: Vec<(usize, Vec<usize>, &'static str)>,
}

/// Runs `f` on zero-filled views of `buffers` (contiguous, 8-byte aligned storage).
fn with_views(buffers: &[(DType, Vec<usize>)], f: &dyn Fn(&[View<'_>]) -> Result<()>) -> Result<()> {
    let layouts: Vec<Layout> = buffers.iter().map(|(_, shape)| Layout::contiguous(shape)).collect();
    let mut stores: Vec<Vec<u64>> = buffers
        .iter()
        .map(|(dt, shape)| vec![0u64; (shape.iter().product::<usize>() * dt.size()).div_ceil(8).max(1)])
        .collect();
    let views: Vec<View<'_>> = stores
        .iter_mut()
        .zip(&layouts)
        .zip(buffers)
        // SAFETY: each store outlives its view, is 8-byte aligned and holds the layout's elements;
        // the views are of distinct stores.
        .map(|((st, l), (dt, _))| unsafe { View::new(st.as_mut_ptr() as *mut u8, st.len() * 8, *dt, l) })
        .collect();
    f(&views)
}

fn check(case: &Case) {
    if let Err(e) = with_views(&case.buffers, &*case.call) {
        panic!("{}: every buffer long enough, yet {e}", case.name);
    }
    for (i, short, words) in &case.shortened {
        let want: usize = case.buffers[*i].1.iter().product();
        assert_eq!(short.iter().product::<usize>() + 1, want, "{}: buffer {i}'s short shape", case.name);
        let mut buffers = case.buffers.clone();
        buffers[*i].1 = short.clone();
        match with_views(&buffers, &*case.call) {
            Err(Error::Invalid(m)) => assert!(
                m.contains(words) && m.contains("elements where the kernel needs"),
                "{}: buffer {i} short gave {m:?}, which does not name {words:?}",
                case.name
            ),
            other => panic!("{}: buffer {i} ({words}) one element short gave {other:?}", case.name),
        }
    }
}

fn f32s(shape: &[usize]) -> (DType, Vec<usize>) {
    (DType::F32, shape.to_vec())
}

/// A one-dimensional shape one element shorter than `shape`.
fn short(shape: &[usize]) -> Vec<usize> {
    vec![shape.iter().product::<usize>() - 1]
}

const ROWS: usize = 3;
const D: usize = 4;
const OUT: usize = 5;

#[test]
fn layer_norm_refuses_short_outputs_and_statistics() {
    check(&Case {
        name: "layer_norm",
        buffers: vec![f32s(&[ROWS, D]), f32s(&[ROWS, D]), f32s(&[ROWS]), f32s(&[ROWS])],
        call: Box::new(|v| kernels::layer_norm(v[0], None, None, D, 1e-5, v[1], Some(v[2]), Some(v[3]))),
        shortened: vec![
            (1, short(&[ROWS, D]), "layer_norm output"),
            (2, short(&[ROWS]), "layer_norm mean"),
            (3, short(&[ROWS]), "layer_norm rstd"),
        ],
    });
}

#[test]
fn layer_norm_backward_refuses_short_operands_and_gradients() {
    check(&Case {
        name: "layer_norm_backward",
        // x, weight, mean, rstd, grad, gx, gw, gb
        buffers: vec![
            f32s(&[ROWS, D]),
            f32s(&[D]),
            f32s(&[ROWS]),
            f32s(&[ROWS]),
            f32s(&[ROWS, D]),
            f32s(&[ROWS, D]),
            f32s(&[D]),
            f32s(&[D]),
        ],
        call: Box::new(|v| {
            kernels::layer_norm_backward(v[0], Some(v[1]), v[2], v[3], D, v[4], Some(v[5]), Some(v[6]), Some(v[7]))
        }),
        shortened: vec![
            (0, short(&[ROWS, D]), "layer_norm_backward input"),
            (3, short(&[ROWS]), "layer_norm_backward rstd"),
            (4, short(&[ROWS, D]), "layer_norm_backward output gradient"),
            (5, short(&[ROWS, D]), "layer_norm_backward input gradient"),
            (6, short(&[D]), "layer_norm_backward weight gradient"),
            (7, short(&[D]), "layer_norm_backward bias gradient"),
        ],
    });
}

#[test]
fn layer_norm_linear_refuses_short_outputs_scratch_and_statistics() {
    check(&Case {
        name: "layer_norm_linear",
        // x, ln weight, ln bias, weight, bias, scratch, out, mean, rstd
        buffers: vec![
            f32s(&[ROWS, D]),
            f32s(&[D]),
            f32s(&[D]),
            f32s(&[OUT, D]),
            f32s(&[OUT]),
            f32s(&[ROWS, D]),
            f32s(&[ROWS, OUT]),
            f32s(&[ROWS]),
            f32s(&[ROWS]),
        ],
        call: Box::new(|v| {
            kernels::layer_norm_linear(
                v[0],
                v[1],
                v[2],
                1e-5,
                v[3],
                Some(v[4]),
                v[5],
                v[6],
                Some(v[7]),
                Some(v[8]),
                F32,
            )
        }),
        shortened: vec![
            (5, short(&[ROWS, D]), "layer_norm_linear scratch"),
            (6, short(&[ROWS, OUT]), "layer_norm_linear output"),
            (7, short(&[ROWS]), "layer_norm_linear mean"),
            (8, short(&[ROWS]), "layer_norm_linear rstd"),
        ],
    });
}

#[test]
fn layer_norm_linear_backward_refuses_short_operands_and_gradients() {
    check(&Case {
        name: "layer_norm_linear_backward",
        // x, ln weight, ln bias, weight, mean, rstd, grad, gx, glw, glb, gw, scratch, sums, gb
        buffers: vec![
            f32s(&[ROWS, D]),
            f32s(&[D]),
            f32s(&[D]),
            f32s(&[OUT, D]),
            f32s(&[ROWS]),
            f32s(&[ROWS]),
            f32s(&[ROWS, OUT]),
            f32s(&[ROWS, D]),
            f32s(&[D]),
            f32s(&[D]),
            f32s(&[OUT, D]),
            f32s(&[ROWS, D]),
            (DType::F64, vec![2, D]),
            f32s(&[OUT]),
        ],
        call: Box::new(|v| {
            kernels::layer_norm_linear_backward(
                v[0],
                v[1],
                v[2],
                v[3],
                v[4],
                v[5],
                v[6],
                Some(v[7]),
                Some(v[8]),
                Some(v[9]),
                Some(v[10]),
                Some(v[13]),
                v[11],
                Some(v[12]),
                F32,
            )
        }),
        shortened: vec![
            (0, short(&[ROWS, D]), "layer_norm_linear_backward input"),
            (6, vec![ROWS * OUT - 1, 1], "layer_norm_linear_backward output gradient"),
            (7, short(&[ROWS, D]), "layer_norm_linear_backward input gradient"),
            (10, short(&[OUT, D]), "layer_norm_linear_backward weight gradient"),
            (11, short(&[ROWS, D]), "layer_norm_linear_backward scratch"),
            (12, short(&[2, D]), "layer_norm_linear_backward column sums"),
            (13, short(&[OUT]), "layer_norm_linear_backward bias gradient"),
        ],
    });
}

#[test]
fn linear_and_matmul_refuse_short_outputs() {
    check(&Case {
        name: "linear",
        buffers: vec![f32s(&[ROWS, D]), f32s(&[OUT, D]), f32s(&[OUT]), f32s(&[ROWS, OUT])],
        call: Box::new(|v| kernels::linear(v[0], v[1], Some(v[2]), v[3], F32)),
        shortened: vec![(3, short(&[ROWS, OUT]), "linear output")],
    });
    check(&Case {
        name: "matmul",
        buffers: vec![f32s(&[ROWS, D]), f32s(&[D, OUT]), f32s(&[ROWS, OUT])],
        call: Box::new(|v| kernels::matmul(v[0], v[1], v[2], F32)),
        // The output's rank names the batch dims: keep it.
        shortened: vec![(2, vec![ROWS * OUT - 1, 1], "matmul output")],
    });
}

#[test]
fn linear_weight_grad_refuses_short_operands_and_gradients() {
    check(&Case {
        name: "linear_weight_grad",
        // grad, x (whose rows are the problem's), gw, gb
        buffers: vec![f32s(&[ROWS, OUT]), f32s(&[ROWS, D]), f32s(&[OUT, D]), f32s(&[OUT])],
        call: Box::new(|v| kernels::linear_weight_grad(v[0], v[1], v[2], Some(v[3]), F32)),
        shortened: vec![
            (0, vec![ROWS * OUT - 1, 1], "linear_weight_grad output gradient"),
            (3, short(&[OUT]), "linear_weight_grad bias gradient"),
        ],
    });
}

#[test]
fn gelu_linear_refuses_short_buffers_forward_and_backward() {
    let stride = kernels::gelu_scratch_stride(D, ROWS);
    check(&Case {
        name: "gelu_linear",
        buffers: vec![f32s(&[ROWS, D]), f32s(&[OUT, D]), f32s(&[OUT]), f32s(&[ROWS, stride]), f32s(&[ROWS, OUT])],
        call: Box::new(|v| kernels::gelu_linear(v[0], v[1], Some(v[2]), v[3], v[4], F32)),
        shortened: vec![
            (3, short(&[ROWS, stride]), "gelu_linear scratch"),
            (4, short(&[ROWS, OUT]), "gelu_linear output"),
        ],
    });
    check(&Case {
        name: "gelu_linear_backward",
        // x, weight, grad, gx, gw, scratch (two blocks: both gradients, out of place), gb
        buffers: vec![
            f32s(&[ROWS, D]),
            f32s(&[OUT, D]),
            f32s(&[ROWS, OUT]),
            f32s(&[ROWS, D]),
            f32s(&[OUT, D]),
            f32s(&[2 * ROWS, stride]),
            f32s(&[OUT]),
        ],
        call: Box::new(|v| {
            kernels::gelu_linear_backward(v[0], v[1], v[2], Some(v[3]), Some(v[4]), Some(v[6]), v[5], F32)
        }),
        shortened: vec![
            (0, short(&[ROWS, D]), "gelu_linear_backward input"),
            (2, vec![ROWS * OUT - 1, 1], "gelu_linear_backward output gradient"),
            (3, short(&[ROWS, D]), "gelu_linear_backward input gradient"),
            (4, short(&[OUT, D]), "gelu_linear_backward weight gradient"),
            (5, short(&[2 * ROWS, stride]), "gelu_linear_backward scratch"),
            (6, short(&[OUT]), "gelu_linear_backward bias gradient"),
        ],
    });
}

#[test]
fn embedding_backward_refuses_short_gradients_and_indices_outside_the_table() {
    let (v_rows, n) = (6, 4);
    // Wide enough rows that the parallel scatter (through a raw pointer) runs.
    let d = 2 * memfit_cpu::PAR_CHUNK / n + 64;
    check(&Case {
        name: "embedding_backward",
        buffers: vec![(DType::I64, vec![n]), f32s(&[n, d]), f32s(&[v_rows, d])],
        call: Box::new(move |v| kernels::embedding_backward(v[0], v[1], v[2], None)),
        // The weight gradient's shape is the table's: it cannot be short of itself.
        shortened: vec![(1, short(&[n, d]), "embedding_backward output gradient")],
    });
    for bad in [-1i64, 6, i64::MAX] {
        let buffers = vec![(DType::I64, vec![2]), f32s(&[2, 3]), f32s(&[v_rows, 3])];
        let got = with_views(&buffers, &|v| {
            v[0].slice_mut::<i64>()?.copy_from_slice(&[0, bad]);
            kernels::embedding_backward(v[0], v[1], v[2], None)
        });
        match got {
            Err(Error::Invalid(m)) => {
                assert!(m.contains(&format!("index {bad} (position 1)")) && m.contains("6 rows"), "{m}")
            }
            other => panic!("index {bad}: {other:?}"),
        }
    }
}

/// Two (batch, head) matrices of 3 x 4 queries, keys and values, as plain stacks.
fn attention_problem(bh: usize, heads: usize) -> AttnProblem {
    let (t, d) = (3, 4);
    let stack = AttnAddr::stack(t, d);
    AttnProblem {
        dims: AttnDims { bh, heads, tq: t, tk: t, d, dv: d },
        lay: AttnLayouts { q: stack, k: stack, v: stack, out: stack },
        scale: 0.5,
        causal: true,
        full: vec![bh, t, t],
        products: F32,
    }
}

#[test]
fn attention_refuses_short_operands_forward_and_backward() {
    let m = [2, 3, 4];
    check(&Case {
        name: "attention",
        // q, k, v, out, lse
        buffers: vec![f32s(&m), f32s(&m), f32s(&m), f32s(&m), f32s(&[2, 3])],
        call: Box::new(|v| {
            kernels::attention(v[0], v[1], v[2], None, &attention_problem(2, 1), v[3], Some(v[4]), None)
        }),
        shortened: vec![
            (0, short(&m), "scaled_dot_product_attention q"),
            (1, short(&m), "scaled_dot_product_attention k"),
            (2, short(&m), "scaled_dot_product_attention v"),
            (3, short(&m), "scaled_dot_product_attention output"),
            (4, short(&[2, 3]), "scaled_dot_product_attention log-sum-exp"),
        ],
    });
    check(&Case {
        name: "attention_delta",
        // out, grad, delta
        buffers: vec![f32s(&m), f32s(&m), f32s(&[2, 3])],
        call: Box::new(|v| kernels::attention_delta(v[0], v[1], &attention_problem(2, 1), v[2])),
        shortened: vec![
            (0, short(&m), "scaled_dot_product_attention_backward output"),
            (1, short(&m), "scaled_dot_product_attention_backward output gradient"),
            (2, short(&[2, 3]), "scaled_dot_product_attention_backward D"),
        ],
    });
    check(&Case {
        name: "attention_backward",
        // q, k, v, lse, grad, gq, gk, gv, delta
        buffers: vec![
            f32s(&m),
            f32s(&m),
            f32s(&m),
            f32s(&[2, 3]),
            f32s(&m),
            f32s(&m),
            f32s(&m),
            f32s(&m),
            f32s(&[2, 3]),
        ],
        call: Box::new(|v| {
            let pb = attention_problem(2, 1);
            kernels::attention_backward(
                v[0],
                v[1],
                v[2],
                None,
                v[3],
                &pb,
                v[4],
                Some(v[8]),
                Some(v[5]),
                Some(v[6]),
                Some(v[7]),
                None,
            )
        }),
        shortened: vec![
            (0, short(&m), "scaled_dot_product_attention_backward q"),
            (3, short(&[2, 3]), "scaled_dot_product_attention_backward log-sum-exp"),
            (4, short(&m), "scaled_dot_product_attention_backward output"),
            (5, short(&m), "gradient of q"),
            (6, short(&m), "gradient of k"),
            (7, short(&m), "gradient of v"),
            (8, short(&[2, 3]), "scaled_dot_product_attention_backward D"),
        ],
    });
    // The gradients of q and k need D; v's alone does not.
    let pb = attention_problem(2, 1);
    let bufs = [f32s(&m), f32s(&[2, 3]), f32s(&m), f32s(&m)];
    let got = with_views(&bufs, &|v| {
        kernels::attention_backward(v[0], v[0], v[0], None, v[1], &pb, v[2], None, None, Some(v[3]), None, None)
    });
    assert!(matches!(&got, Err(Error::Invalid(m)) if m.contains("need each row's D")), "{got:?}");
    let got = with_views(&bufs, &|v| {
        kernels::attention_backward(v[0], v[0], v[0], None, v[1], &pb, v[2], None, None, None, Some(v[3]), None)
    });
    assert!(got.is_ok(), "{got:?}");
    // Heads that do not divide the matrices: the last matrix would not start furthest in.
    let got = with_views(&[f32s(&m), f32s(&m), f32s(&m), f32s(&m)], &|v| {
        kernels::attention(v[0], v[1], v[2], None, &attention_problem(3, 2), v[3], None, None)
    });
    assert!(matches!(&got, Err(Error::Invalid(m)) if m.contains("3 matrices") && m.contains("2 heads")), "{got:?}");
}

/// Self-attention on one packed [1, T, 3E] projection (q, k and v its column thirds) with 2 heads of
/// `dh`, the output [1, T, E], as the packed op lays them out.
fn packed_problem(t: usize, dh: usize) -> AttnProblem {
    let e = 2 * dh;
    let part = |i: usize| AttnAddr { offset: i * e, batch_stride: t * 3 * e, head_stride: dh, row_stride: 3 * e };
    AttnProblem {
        dims: AttnDims { bh: 2, heads: 2, tq: t, tk: t, d: dh, dv: dh },
        lay: AttnLayouts {
            q: part(0),
            k: part(1),
            v: part(2),
            out: AttnAddr { offset: 0, batch_stride: t * e, head_stride: dh, row_stride: e },
        },
        scale: 0.5,
        causal: true,
        full: vec![1, 2, t, t],
        products: F32,
    }
}

#[test]
fn packed_attention_checks_each_part_of_its_one_gradient_and_needs_nothing_for_no_rows() {
    let (t, dh) = (3, 4);
    let packed = [1, t, 6 * dh];
    // q, k and v are column thirds of one tensor, and so are their gradients: one element short,
    // only v's third (the furthest) runs past it.
    check(&Case {
        name: "packed attention_backward",
        // qkv, lse (and D), grad, the packed gradient
        buffers: vec![f32s(&packed), f32s(&[2, t]), f32s(&[1, t, 2 * dh]), f32s(&packed)],
        call: Box::new(move |v| {
            let pb = packed_problem(t, dh);
            kernels::attention_backward(
                v[0],
                v[0],
                v[0],
                None,
                v[1],
                &pb,
                v[2],
                Some(v[1]),
                Some(v[3]),
                Some(v[3]),
                Some(v[3]),
                None,
            )
        }),
        shortened: vec![(3, short(&packed), "gradient of v")],
    });
    // No rows: nothing is read or written, so empty buffers do (k and v start at an offset).
    let got = with_views(&[f32s(&[1, 0, 6 * dh]), f32s(&[2, 0]), f32s(&[1, 0, 2 * dh]), f32s(&[1, 0, 6 * dh])], &|v| {
        let pb = packed_problem(0, dh);
        kernels::attention(v[0], v[0], v[0], None, &pb, v[2], Some(v[1]), None)?;
        kernels::attention_delta(v[2], v[2], &pb, v[1])?;
        kernels::attention_backward(
            v[0],
            v[0],
            v[0],
            None,
            v[1],
            &pb,
            v[2],
            Some(v[1]),
            Some(v[3]),
            Some(v[3]),
            Some(v[3]),
            None,
        )
    });
    assert!(got.is_ok(), "{got:?}");
}

#[test]
fn pooling_refuses_short_inputs_outputs_and_positions() {
    // Two planes of 4 x 5 pooled by 2 x 2 windows, stride 2: 2 x 2 outputs each.
    let g = PoolGeom { planes: 2, h: 4, w: 5, oh: 2, ow: 2, kh: 2, kw: 2, sh: 2, sw: 2, ph: 0, pw: 0, dh: 1, dw: 1 };
    let (x, o) = ([2, 4, 5], [2, 2, 2]);
    check(&Case {
        name: "max_pool2d",
        buffers: vec![f32s(&x), f32s(&o), (DType::I64, o.to_vec()), (DType::U8, o.to_vec())],
        call: Box::new(move |v| kernels::max_pool2d(&g, v[0], v[1], Some(v[2]), Some(v[3]), 1)),
        shortened: vec![
            (0, short(&x), "max_pool2d input"),
            (1, short(&o), "max_pool2d output"),
            (2, short(&o), "max_pool2d indices"),
            (3, short(&o), "max_pool2d positions"),
        ],
    });
    check(&Case {
        name: "max_pool2d_backward",
        // grad, positions (two bytes each), dx
        buffers: vec![f32s(&o), (DType::U8, vec![2, 2, 2, 2]), f32s(&x)],
        call: Box::new(move |v| kernels::max_pool2d_backward(&g, 2, v[0], v[1], v[2])),
        shortened: vec![
            (0, short(&o), "max_pool2d_backward output gradient"),
            (1, short(&[2, 2, 2, 2]), "max_pool2d_backward positions"),
            (2, short(&x), "max_pool2d_backward input gradient"),
        ],
    });
    for (kind, name) in [(Avg::Fixed { count_include_pad: true }, "avg_pool2d"), (Avg::Adaptive, "adaptive_avg_pool2d")]
    {
        check(&Case {
            name: "avg pool",
            buffers: vec![f32s(&x), f32s(&o)],
            call: Box::new(move |v| kernels::avg_pool2d(&g, kind, v[0], v[1])),
            shortened: vec![
                (0, short(&x), leak(format!("{name} input"))),
                (1, short(&o), leak(format!("{name} output"))),
            ],
        });
        check(&Case {
            name: "avg pool backward",
            buffers: vec![f32s(&o), f32s(&x)],
            call: Box::new(move |v| kernels::avg_pool2d_backward(&g, kind, v[0], v[1])),
            shortened: vec![
                (0, short(&o), leak(format!("{name} backward output gradient"))),
                (1, short(&x), leak(format!("{name} backward input gradient"))),
            ],
        });
    }
}

fn leak(s: String) -> &'static str {
    Box::leak(s.into_boxed_str())
}

/// A 3x3 convolution with padding 1 of 2 samples of 4 x 5 x 5 into 6 channels, tiles of whole
/// samples: through im2col (groups 1) or tap by tap (depthwise, groups 4 with 8 outputs).
fn conv_geom(depthwise: bool) -> memfit_cpu::conv::ConvGeom {
    memfit_cpu::conv::ConvGeom {
        n: 2,
        c: 4,
        h: 5,
        w: 5,
        o: if depthwise { 8 } else { 6 },
        kh: 3,
        kw: 3,
        oh: 5,
        ow: 5,
        sh: 1,
        sw: 1,
        ph: 1,
        pw: 1,
        dh: 1,
        dw: 1,
        groups: if depthwise { 4 } else { 1 },
        direct: false,
        depthwise,
        tile_rows: 5,
        lanes: 1,
        per_lane: 2,
        batch: 1,
        products: F32,
    }
}

#[test]
fn conv2d_refuses_short_inputs_weights_outputs_and_gradients() {
    for depthwise in [false, true] {
        let g = conv_geom(depthwise);
        let (x, w, b, o) = ([2, 4, 5, 5], [g.o, g.c / g.groups, 3, 3], [g.o], [2, g.o, 5, 5]);
        let ws = [g.lanes * (g.col_len() + g.out_len()).max(1)];
        check(&Case {
            name: "conv2d",
            buffers: vec![f32s(&x), f32s(&w), f32s(&b), f32s(&o), f32s(&ws)],
            call: Box::new(move |v| {
                kernels::conv2d(&g, v[0], v[1], Some(v[2]), v[3], (g.col_len() > 0).then_some(v[4]))
            }),
            shortened: vec![
                (0, short(&x), "conv2d input"),
                (1, short(&w), "conv2d weight"),
                (2, short(&b), "conv2d bias"),
                (3, short(&o), "conv2d output"),
            ],
        });
        let (wsb, parts) = ([g.lanes * (g.col_len() + g.gt_len()).max(1)], [g.lanes * g.weight_len()]);
        check(&Case {
            name: "conv2d_backward",
            // x, weight, grad, dx, dw, partials, workspace
            buffers: vec![f32s(&x), f32s(&w), f32s(&o), f32s(&x), f32s(&w), f32s(&parts), f32s(&wsb)],
            call: Box::new(move |v| {
                let (parts, ws) = if depthwise { (None, None) } else { (Some(v[5]), Some(v[6])) };
                kernels::conv2d_backward(&g, v[0], v[1], v[2], Some(v[3]), Some(v[4]), None, parts, ws)
            }),
            shortened: vec![
                (0, short(&x), "conv2d input"),
                (1, short(&w), "conv2d weight"),
                (2, short(&o), "conv2d output gradient"),
                (3, short(&x), "conv2d input gradient"),
                (4, short(&w), "conv2d weight gradient"),
            ],
        });
    }
}
