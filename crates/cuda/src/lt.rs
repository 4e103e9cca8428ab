//! cuBLASLt's products with a bias epilogue ([`Gemm::bias`]): a linear layer's bias added as the
//! product writes C, instead of broadcast into C by a kernel and read back by the product (beta 1),
//! two passes over the output that the epilogue saves. Opened on first use where `libcublasLt.so.13`
//! is present (cuBLAS needs it, so it is where cuBLAS is) and checked once on the GPU against the
//! host ([`check_values`]); where either fails the backend broadcasts the bias as before.
//!
//! The 16-bit products of rounded operands (`GemmType::Bf16`, `F16`, into f32) take the bias
//! epilogue too, each type checked once the same way with its operands in 16 bits (small integers,
//! exact), so a bf16 linear layer's bias is not broadcast into C first either. cuBLASLt also runs
//! those products without a bias when `MEMFIT_CUDA_LT_PRODUCTS=1` asks: an experiment for issue 32,
//! where an H100 spent about 300 us on the host inside cuBLAS's call for GPT-2's QKV product whose
//! kernel took 42 us. Each shape's algorithm is asked of cuBLASLt's heuristic once and kept
//! ([`Lt::algorithms`]), told how A, B and C are aligned; a bias not 16-byte aligned is broadcast
//! first instead (no preference says how a bias is aligned).

use crate::machine::{Gemm, GemmType};
use crate::{call_error, CudaError};
use cudarc::cublaslt::sys as lt;
use std::ffi::c_void;

/// A cuBLASLt handle, and the algorithm its heuristic chose for each product shape so far.
pub(crate) struct Lt {
    handle: lt::cublasLtHandle_t,
    algorithms: std::sync::Mutex<std::collections::HashMap<Shape, lt::cublasLtMatmulAlgo_t>>,
}

/// What cuBLASLt's choice of algorithm depends on: the product's types, operations, sizes,
/// layouts, batch, whether it has a bias and a beta, and how its pointers are aligned.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Shape {
    dtype: GemmType,
    ops: (bool, bool),
    mnk: (usize, usize, usize),
    lds: (usize, usize, usize),
    batch: usize,
    strides: (usize, usize, usize),
    bias: bool,
    beta: bool,
    /// The alignment (bytes, at most 256) of A, B, C and the bias: the heuristic is told A's, B's
    /// and C's ([`alignment`]), so its choice depends on them.
    alignment: [u32; 4],
}

/// The largest power of two, at most 256, that divides the address `p` (256 for none): what
/// cuBLASLt's heuristic is told a pointer is aligned to (`CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_*`).
/// Told nothing, it takes 256-byte pointers, and a block of a larger matrix (a rounded product
/// cut in blocks) may not be: a kernel that reads it as such faults (PyTorch issue #98975).
fn alignment(p: u64) -> u32 {
    if p == 0 {
        256
    } else {
        1 << p.trailing_zeros().min(8)
    }
}

impl Shape {
    fn of(g: &Gemm) -> Shape {
        Shape {
            dtype: g.dtype,
            ops: (g.transa, g.transb),
            mnk: (g.m, g.n, g.k),
            lds: (g.lda, g.ldb, g.ldc),
            batch: g.batch,
            strides: (g.stride_a, g.stride_b, g.stride_c),
            bias: g.bias != 0,
            beta: g.beta != 0.0,
            alignment: [g.a, g.b, g.c, g.bias].map(alignment),
        }
    }
}

// SAFETY: the handle is used under the GPU's lock on its one stream (`Gpu::lt`), never concurrently.
unsafe impl Send for Lt {}
// SAFETY: as above.
unsafe impl Sync for Lt {}

fn ok(what: &str, status: lt::cublasStatus_t) -> Result<(), CudaError> {
    if status == lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        Ok(())
    } else {
        Err(call_error(what, status))
    }
}

/// The descriptors of one product, destroyed when dropped.
struct Descriptors {
    matmul: lt::cublasLtMatmulDesc_t,
    layouts: Vec<lt::cublasLtMatrixLayout_t>,
    preference: lt::cublasLtMatmulPreference_t,
}

impl Drop for Descriptors {
    fn drop(&mut self) {
        // SAFETY: each was created by cuBLASLt (or is null, which its destroy calls accept).
        unsafe {
            for &l in &self.layouts {
                lt::cublasLtMatrixLayoutDestroy(l);
            }
            lt::cublasLtMatmulDescDestroy(self.matmul);
            lt::cublasLtMatmulPreferenceDestroy(self.preference);
        }
    }
}

impl Lt {
    /// A handle, or why there is none (the library missing, or its creation failing).
    pub(crate) fn open() -> Result<Lt, CudaError> {
        // SAFETY: only tries to load the library.
        if !unsafe { lt::is_culib_present() } {
            return Err(call_error("cuBLASLt", "libcublasLt.so.13 not found"));
        }
        let mut handle = std::ptr::null_mut();
        // SAFETY: the library is loadable (above); the call writes the handle.
        ok("cublasLtCreate", unsafe { lt::cublasLtCreate(&mut handle) })?;
        Ok(Lt { handle, algorithms: std::sync::Mutex::new(std::collections::HashMap::new()) })
    }

    /// Queues `g` on `stream`: C = alpha op(A) op(B) (+ beta C) (+ bias, `bias[i]` added to row i
    /// of every column, where `g.bias` is set), each of a strided batch, with `workspace_bytes` of
    /// workspace. f32 products and products of rounded 16-bit operands (`GemmType::Bf16`, `F16`)
    /// into f32, each with or without a bias (f32).
    ///
    /// # Safety
    /// The operands, the bias and the workspace are device memory of the handle's context holding
    /// what `g` describes; `stream` is that context's.
    pub(crate) unsafe fn matmul(
        &self,
        g: &Gemm,
        workspace: u64,
        workspace_bytes: usize,
        stream: *mut c_void,
    ) -> Result<(), CudaError> {
        let f32_type = lt::cudaDataType_t::CUDA_R_32F;
        let operand_type = match (g.dtype, g.bias != 0) {
            (GemmType::F32, true) => f32_type,
            (GemmType::Bf16, _) => lt::cudaDataType_t::CUDA_R_16BF,
            (GemmType::F16, _) => lt::cudaDataType_t::CUDA_R_16F,
            _ => return Err(call_error("cuBLASLt", format!("a {:?} product (bias {})", g.dtype, g.bias != 0))),
        };
        let compute = lt::cublasComputeType_t::CUBLAS_COMPUTE_32F;
        let mut d = Descriptors { matmul: std::ptr::null_mut(), layouts: Vec::new(), preference: std::ptr::null_mut() };
        ok("cublasLtMatmulDescCreate", lt::cublasLtMatmulDescCreate(&mut d.matmul, compute, f32_type))?;
        let op = |t: bool| {
            if t {
                cudarc::cublas::sys::cublasOperation_t::CUBLAS_OP_T
            } else {
                cudarc::cublas::sys::cublasOperation_t::CUBLAS_OP_N
            }
        };
        let set = |attr, value: *const c_void, size: usize| {
            ok("cublasLtMatmulDescSetAttribute", lt::cublasLtMatmulDescSetAttribute(d.matmul, attr, value, size))
        };
        use lt::cublasLtMatmulDescAttributes_t as A;
        let (ta, tb) = (op(g.transa), op(g.transb));
        set(
            A::CUBLASLT_MATMUL_DESC_TRANSA,
            (&ta as *const cudarc::cublas::sys::cublasOperation_t).cast(),
            std::mem::size_of_val(&ta),
        )?;
        set(
            A::CUBLASLT_MATMUL_DESC_TRANSB,
            (&tb as *const cudarc::cublas::sys::cublasOperation_t).cast(),
            std::mem::size_of_val(&tb),
        )?;
        if g.bias != 0 {
            let epilogue = lt::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS;
            set(
                A::CUBLASLT_MATMUL_DESC_EPILOGUE,
                (&epilogue as *const lt::cublasLtEpilogue_t).cast(),
                std::mem::size_of_val(&epilogue),
            )?;
            let bias = g.bias as *const c_void;
            set(
                A::CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                (&bias as *const *const c_void).cast(),
                std::mem::size_of_val(&bias),
            )?;
            set(
                A::CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
                (&f32_type as *const lt::cudaDataType_t).cast(),
                std::mem::size_of_val(&f32_type),
            )?;
        }
        // The stored matrices: A is k x m when transposed, else m x k (column-major), B likewise;
        // each of a batch `stride` elements after the one before.
        let (a_rows, a_cols) = if g.transa { (g.k, g.m) } else { (g.m, g.k) };
        let (b_rows, b_cols) = if g.transb { (g.n, g.k) } else { (g.k, g.n) };
        let stored = [
            (operand_type, a_rows, a_cols, g.lda, g.stride_a),
            (operand_type, b_rows, b_cols, g.ldb, g.stride_b),
            (f32_type, g.m, g.n, g.ldc, g.stride_c),
        ];
        for (dtype, rows, cols, ld, stride) in stored {
            let mut layout = std::ptr::null_mut();
            ok(
                "cublasLtMatrixLayoutCreate",
                lt::cublasLtMatrixLayoutCreate(&mut layout, dtype, rows as u64, cols as u64, ld as i64),
            )?;
            d.layouts.push(layout);
            if g.batch > 1 {
                use lt::cublasLtMatrixLayoutAttribute_t as L;
                let (count, offset) = (g.batch as i32, stride as i64);
                let set_layout = |attr, value: *const c_void, size| {
                    ok(
                        "cublasLtMatrixLayoutSetAttribute",
                        lt::cublasLtMatrixLayoutSetAttribute(layout, attr, value, size),
                    )
                };
                set_layout(L::CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, (&count as *const i32).cast(), 4)?;
                set_layout(L::CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, (&offset as *const i64).cast(), 8)?;
            }
        }
        ok("cublasLtMatmulPreferenceCreate", lt::cublasLtMatmulPreferenceCreate(&mut d.preference))?;
        let bytes = workspace_bytes as u64;
        ok(
            "cublasLtMatmulPreferenceSetAttribute",
            lt::cublasLtMatmulPreferenceSetAttribute(
                d.preference,
                lt::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                (&bytes as *const u64).cast(),
                std::mem::size_of_val(&bytes),
            ),
        )?;
        use lt::cublasLtMatmulPreferenceAttributes_t as P;
        for (attr, p) in [
            (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, g.a),
            (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, g.b),
            (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, g.c),
            (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, g.c),
        ] {
            let bytes = alignment(p);
            ok(
                "cublasLtMatmulPreferenceSetAttribute",
                lt::cublasLtMatmulPreferenceSetAttribute(
                    d.preference,
                    attr,
                    (&bytes as *const u32).cast(),
                    std::mem::size_of_val(&bytes),
                ),
            )?;
        }
        let (la, lb, lc) = (d.layouts[0], d.layouts[1], d.layouts[2]);
        // The shape's algorithm: the heuristic's first choice, asked once.
        let shape = Shape::of(g);
        let known = self.algorithms.lock().unwrap_or_else(|e| e.into_inner()).get(&shape).copied();
        let algo = match known {
            Some(algo) => algo,
            None => {
                let mut found: lt::cublasLtMatmulHeuristicResult_t = std::mem::zeroed();
                let mut count = 0;
                ok(
                    "cublasLtMatmulAlgoGetHeuristic",
                    lt::cublasLtMatmulAlgoGetHeuristic(
                        self.handle,
                        d.matmul,
                        la,
                        lb,
                        lc,
                        lc,
                        d.preference,
                        1,
                        &mut found,
                        &mut count,
                    ),
                )?;
                if count < 1 {
                    return Err(call_error("cuBLASLt", format!("no algorithm for {shape:?}")));
                }
                self.algorithms.lock().unwrap_or_else(|e| e.into_inner()).insert(shape, found.algo);
                found.algo
            }
        };
        let (alpha, beta) = (g.alpha as f32, g.beta as f32);
        ok(
            "cublasLtMatmul",
            lt::cublasLtMatmul(
                self.handle,
                d.matmul,
                (&alpha as *const f32).cast(),
                g.a as *const c_void,
                la,
                g.b as *const c_void,
                lb,
                (&beta as *const f32).cast(),
                g.c as *const c_void,
                lc,
                g.c as *mut c_void,
                lc,
                &algo,
                workspace as *mut c_void,
                workspace_bytes,
                stream.cast(),
            ),
        )
    }
}

impl Drop for Lt {
    fn drop(&mut self) {
        // SAFETY: the handle is ours and no longer used.
        unsafe {
            lt::cublasLtDestroy(self.handle);
        }
    }
}

/// The check's product (below) as a [`Gemm`] of `dtype` (f32, or 16-bit operands into f32) at those
/// device addresses.
pub fn check_gemm(dtype: GemmType, transa: bool, a: u64, b: u64, bias: u64, c: u64) -> Gemm {
    Gemm {
        dtype,
        transa,
        transb: false,
        m: 16,
        n: 8,
        k: 16,
        alpha: 1.0,
        a,
        lda: 16,
        stride_a: 0,
        b,
        ldb: 16,
        stride_b: 0,
        beta: 0.0,
        c,
        ldc: 16,
        stride_c: 0,
        batch: 1,
        bias,
    }
}

/// The check's product: m 16, n 8, k 16, small integers (every sum exact in any order), A read
/// transposed (as a linear layer's weight is) or not; bias[i] = i - 8. Returns the operands A (as
/// stored), B, the bias and the product with the bias, column-major.
pub fn check_values(transa: bool) -> [Vec<f32>; 4] {
    let (m, n, k) = (16, 8, 16);
    let a = |i: usize, l: usize| ((3 * i + 5 * l) % 7) as f32 - 3.0;
    let b = |l: usize, j: usize| ((2 * l + 3 * j) % 5) as f32 - 2.0;
    let stored_a: Vec<f32> = if transa {
        (0..m).flat_map(|i| (0..k).map(move |l| a(i, l))).collect() // k x m, column i holds row i of A
    } else {
        (0..k).flat_map(|l| (0..m).map(move |i| a(i, l))).collect()
    };
    let stored_b: Vec<f32> = (0..n).flat_map(|j| (0..k).map(move |l| b(l, j))).collect();
    let bias: Vec<f32> = (0..m).map(|i| i as f32 - 8.0).collect();
    let c: Vec<f32> = (0..n)
        .flat_map(|j| (0..m).map(move |i| (0..k).map(|l| a(i, l) * b(l, j)).sum::<f32>() + i as f32 - 8.0))
        .collect();
    [stored_a, stored_b, bias, c]
}

/// The check's operand values as `dtype` stores them (f32, or bf16 and fp16 bits: small integers,
/// exact in each), little-endian bytes.
pub fn check_operand_bytes(dtype: GemmType, values: &[f32]) -> Vec<u8> {
    match dtype {
        GemmType::Bf16 => values.iter().flat_map(|&v| half::bf16::from_f32(v).to_bits().to_le_bytes()).collect(),
        GemmType::F16 => values.iter().flat_map(|&v| half::f16::from_f32(v).to_bits().to_le_bytes()).collect(),
        _ => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alignment_is_the_largest_power_of_two_up_to_256() {
        assert_eq!([0, 4, 12, 16, 48, 512, 1 << 20, 0x7f00_0000_0104].map(alignment), [256, 4, 4, 16, 16, 256, 256, 4]);
    }

    #[test]
    fn the_check_operands_are_exact_in_16_bits() {
        let [a, b, ..] = check_values(true);
        for dtype in [GemmType::Bf16, GemmType::F16] {
            let bytes = check_operand_bytes(dtype, &a);
            assert_eq!(bytes.len(), 2 * a.len());
            let back: Vec<f32> = bytes
                .chunks_exact(2)
                .map(|c| u16::from_le_bytes([c[0], c[1]]))
                .map(|bits| {
                    if dtype == GemmType::Bf16 {
                        half::bf16::from_bits(bits).to_f32()
                    } else {
                        half::f16::from_bits(bits).to_f32()
                    }
                })
                .collect();
            assert_eq!(back, a, "{dtype:?}");
            assert_eq!(check_operand_bytes(dtype, &b).len(), 2 * b.len());
        }
        assert_eq!(check_operand_bytes(GemmType::F32, &[1.5]), 1.5f32.to_le_bytes());
    }

    #[test]
    fn the_check_product_is_the_definition_either_way_a_is_stored() {
        let [a_t, b, bias, c] = check_values(true);
        let [a_n, _, _, c_n] = check_values(false);
        assert_eq!(c, c_n);
        // Element (i, l) of A: at l + i * k transposed, i + l * m not.
        for (i, l) in [(0, 0), (3, 7), (15, 15), (9, 2)] {
            assert_eq!(a_t[l + i * 16], a_n[i + l * 16]);
        }
        // C(2, 5) by hand.
        let want: f32 = (0..16).map(|l| a_n[2 + l * 16] * b[l + 5 * 16]).sum::<f32>() + bias[2];
        assert_eq!(c[2 + 5 * 16], want);
        assert_eq!(bias[0], -8.0);
    }
}
