//! The emulator runs memfit's kernel sources on the host: kernels with block barriers and shared
//! memory, strided views and cuBLAS's column-major products behave as their definitions say. (The
//! backend's own tests run every op through it; these check the machine itself.)

use memfit_cuda::{Arg, Emulator, Gemm, GemmType, Launch, Machine, Strided};

fn upload_f32(m: &Emulator, values: &[f32]) -> u64 {
    let address = m.alloc(values.len() * 4).unwrap();
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    m.upload(address, &bytes).unwrap();
    address
}

fn download_f32(m: &Emulator, address: u64, n: usize) -> Vec<f32> {
    let mut bytes = vec![0u8; n * 4];
    m.download(address, &mut bytes).unwrap();
    bytes.chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect()
}

#[test]
fn element_wise_strided_and_block_reduction_kernels_run() {
    let m = Emulator::open().expect("the emulator builds with the host's C++ compiler");
    let x = upload_f32(&m, &[-1.0, 2.0, -3.0, 4.0, 5.0, -6.0]);
    let out = m.alloc(24).unwrap();
    // relu over 6 elements with a grid smaller than the elements (grid-stride loop).
    m.launch("unary_f32", Launch { grid: 1, block: 2 }, &mut [Arg::I32(0), Arg::Ptr(x), Arg::Ptr(out), Arg::I64(6)])
        .unwrap();
    assert_eq!(download_f32(&m, out, 6), [0.0, 2.0, 0.0, 4.0, 5.0, 0.0]);
    // A transposed gather: x as [2, 3] read column by column.
    let view = Strided::new(&[3, 2], &[1, 3], 0).unwrap();
    m.launch(
        "gather_b4",
        Launch { grid: 2, block: 4 },
        &mut [Arg::Ptr(out), Arg::Ptr(x), Arg::View(view), Arg::I64(6)],
    )
    .unwrap();
    assert_eq!(download_f32(&m, out, 6), [-1.0, 4.0, 2.0, 5.0, -3.0, -6.0]);
    // Softmax rows through block_max/block_sum (barriers between fibers).
    m.launch(
        "softmax_f32",
        Launch { grid: 1, block: 256 },
        &mut [Arg::Ptr(x), Arg::I64(2), Arg::I64(3), Arg::I64(1), Arg::I32(0), Arg::Ptr(out)],
    )
    .unwrap();
    let got = download_f32(&m, out, 6);
    let e = [(-1f32 - 2.0).exp(), 1.0, (-3f32 - 2.0).exp()];
    let s: f32 = e.iter().sum();
    for (g, want) in got[..3].iter().zip(e.iter().map(|v| v / s)) {
        assert!((g - want).abs() < 1e-6, "{got:?}");
    }
    assert!(m.launch("no_such_kernel", Launch { grid: 1, block: 1 }, &mut []).is_err());
}

#[test]
fn gemm_follows_cublas_column_major_definition() {
    let m = Emulator::open().unwrap();
    // Row-major A [2, 3] and B [3, 2]: C = A B, as cuBLAS computes C^T = B^T A^T column-major.
    let a = upload_f32(&m, &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
    let b = upload_f32(&m, &[7.0, 8.0, 9.0, 10.0, 11.0, 12.0]);
    let c = upload_f32(&m, &[f32::NAN; 4]);
    let g = Gemm {
        dtype: GemmType::F32,
        transa: false,
        transb: false,
        m: 2,
        n: 2,
        k: 3,
        alpha: 1.0,
        a: b,
        lda: 2,
        stride_a: 0,
        b: a,
        ldb: 3,
        stride_b: 0,
        beta: 0.0,
        c,
        ldc: 2,
        stride_c: 0,
        batch: 1,
        bias: 0,
    };
    m.gemm(&g).unwrap();
    assert_eq!(download_f32(&m, c, 4), [58.0, 64.0, 139.0, 154.0]);
    // beta = 1 accumulates; transposed A.
    m.gemm(&Gemm { beta: 1.0, ..g }).unwrap();
    assert_eq!(download_f32(&m, c, 4), [116.0, 128.0, 278.0, 308.0]);
    // A bias epilogue: bias[i] added to row i of every column (beta 0).
    let bias = upload_f32(&m, &[0.5, -1.0]);
    m.gemm(&Gemm { bias, ..g }).unwrap();
    assert_eq!(download_f32(&m, c, 4), [58.5, 63.0, 139.5, 153.0]);
    assert!(m.gemm(&Gemm { bias, beta: 1.0, ..g }).is_err(), "a bias with beta 1 is refused");
}

#[test]
fn lt_check_values_pass_through_the_emulated_bias_product() {
    // The check `Gpu::fuses_bias` runs on a GPU, here through the emulator's definition.
    // On f32 operands and on bf16 and fp16 ones (the rounded products' bias epilogue).
    let m = Emulator::open().unwrap();
    for dtype in [GemmType::F32, GemmType::Bf16, GemmType::F16] {
        for transa in [true, false] {
            let [a, b, bias, want] = memfit_cuda::lt::check_values(transa);
            let operand = |v: &[f32]| {
                let bytes = memfit_cuda::lt::check_operand_bytes(dtype, v);
                let at = m.alloc(bytes.len()).unwrap();
                m.upload(at, &bytes).unwrap();
                at
            };
            let (a, b, bias) = (operand(&a), operand(&b), upload_f32(&m, &bias));
            let c = upload_f32(&m, &[f32::NAN; 128]);
            let g = memfit_cuda::lt::check_gemm(dtype, transa, a, b, bias, c);
            m.gemm(&g).unwrap();
            assert_eq!(download_f32(&m, c, 128), want, "{dtype:?}, transa {transa}");
        }
    }
}

/// repeat_row into a block of a larger matrix (the bias broadcast of a product cut in blocks, when
/// cuBLASLt refuses it or its bias is not 16-byte aligned): each of `rows` rows of `cols` values,
/// rows `ld` apart, gets the source row; the values between the rows are kept.
#[test]
fn repeat_row_fills_a_block_with_its_leading_dimension() {
    let m = Emulator::open().unwrap();
    let (rows, cols, ld) = (3, 4, 7);
    let dst = upload_f32(&m, &[-1.0; 3 * 7]);
    let src = upload_f32(&m, &[1.0, 2.0, 3.0, 4.0]);
    m.launch(
        "repeat_row_b4",
        Launch { grid: 2, block: 2 },
        &mut [Arg::Ptr(dst), Arg::Ptr(src), Arg::I64(1), Arg::I64(rows), Arg::I64(cols), Arg::I64(ld)],
    )
    .unwrap();
    let got = download_f32(&m, dst, 3 * 7);
    for (i, v) in got.iter().enumerate() {
        let want = if i % 7 < 4 { (i % 7 + 1) as f32 } else { -1.0 };
        assert_eq!(*v, want, "element {i}: {got:?}");
    }
}
