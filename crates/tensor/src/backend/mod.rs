//! The backend seam: the one place that decides which code computes an op for a device.
//!
//! An op (`ops/*`) says what it means: it checks shapes and dtypes, allocates its outputs from the
//! device's allocator (identically on every device, so `meta` predicts `cpu` to the byte), records
//! autograd, and then asks its device's [`Backend`] to fill the outputs. The backends:
//!
//! - `cpu` (`backend/cpu.rs`): the crate `memfit-cpu`, one kernel per method, given [`View`]s of
//!   the tensors (storage, dtype, layout). Each matches the dtype once (`with_float!`) and calls
//!   `memfit-kernels` for what has a path per instruction set (GEMM, GELU, exp), chosen at run time.
//! - `meta` ([`Meta`], below): computes nothing; every kernel is a no-op, so a meta run is the cpu
//!   run's allocation sequence and nothing else (or a GPU's: `meta:cuda`, whose ops size their
//!   workspaces as the GPU's kernels need them, see `Device::target`).
//! - `cuda` (`backend/cuda.rs`): launches on a GPU opened through `memfit-cuda` (or on its
//!   emulator, `MEMFIT_CUDA_EMULATOR=1`): the kernels' CUDA C sources and cuBLAS for products.
//!
//! Adding a device is adding one implementation of [`Backend`] (and a `SegmentBackend` for its
//! memory) and its arm in [`open`]; adding a dtype (f16/bf16 storage) is adding arms to the CPU
//! kernels' dtype match (`with_float!`, `memfit-cpu/src/dtype.rs`) and the conversions in
//! `memfit-kernels`. Ops never branch on the device.
//!
//! The trait lists each kernel once ([`backends!`]); both backends' implementations are generated from
//! the same list (meta: no-ops; cpu: calls to the `memfit-cpu` kernel of the same name), so a kernel
//! cannot be added to one backend and forgotten in the other.
//!
//! [`View`]: memfit_cpu::View

pub(crate) mod cpu;
pub(crate) mod cuda;

use crate::device::DeviceKind;
use crate::error::Result;
use crate::tensor::Tensor;
use memfit_memory::{HostBackend, MetaBackend, SegmentBackend};

pub(crate) use cpu::Cpu;

/// Declares [`Backend`] with one method per kernel, [`Meta`] implementing each as a no-op, and
/// [`Cpu`] implementing each by the function of the same name in `memfit_cpu::kernels`.
macro_rules! backends {
    ($( $(#[$doc:meta])* fn $name:ident(&self $(, $arg:ident: $ty:ty)* $(,)?); )*) => {
        /// The kernels a device runs. Each fills outputs the op has already allocated; none
        /// allocates a tensor of its own except through the op's tensors.
        pub(crate) trait Backend: Send + Sync {
            $( $(#[$doc])* fn $name(&self $(, $arg: $ty)*) -> Result<()>; )*

            /// `unscale` of each of `grads`, `found_inf` set when any held an inf or NaN. A GPU
            /// reads its flag back once for all of them (one synchronisation, not one per tensor).
            fn unscale_all(&self, grads: &[&Tensor], inv_scale: f64, found_inf: &mut bool) -> Result<()> {
                for g in grads {
                    self.unscale(g, inv_scale, found_inf)?;
                }
                Ok(())
            }

            /// `adam_update` of each `[param, grad, exp_avg, exp_avg_sq]` of `group` (dense moments of
            /// the parameter's dtype), all at `step`. A GPU updates many tensors in one launch (the
            /// optimizer's step is otherwise a launch per parameter); the bits are `adam_update`'s.
            fn adam_update_all(&self, group: &[[&Tensor; 4]], step: crate::ops::AdamStep) -> Result<()> {
                for [param, grad, exp_avg, exp_avg_sq] in group {
                    self.adam_update(param, grad, exp_avg, exp_avg_sq, step)?;
                }
                Ok(())
            }

            /// A linear layer's backward with both gradients wanted: its input gradient
            /// `gx = grad W` ([rows, in], from `weight` [out, in]) and, as
            /// [`Backend::linear_weight_grad`], its weight (and bias) gradient. A GPU rounds `grad`
            /// once for both products where they round it (Note [Held operands] in `cuda.rs`); `x`
            /// may then be saved in their own 16-bit format, their operand bits already.
            #[allow(clippy::too_many_arguments)]
            fn linear_backward(
                &self,
                grad: &Tensor,
                x: &Tensor,
                weight: &Tensor,
                gx: &Tensor,
                gw: &Tensor,
                gb: Option<&Tensor>,
                products: crate::Products,
            ) -> Result<()> {
                self.matmul(grad, weight, gx, products)?;
                self.linear_weight_grad(grad, x, gw, gb, products)
            }

            /// Overwrites every byte of the contiguous tensor `t` with what `fill` writes into the
            /// buffer it is given (all of it; the buffer's old contents are undefined), without
            /// reading `t` first; the buffer is 8-byte aligned at least. With `staged` (data that
            /// changes every step), a GPU fills one of its pinned host buffers and copies it in
            /// stream order without waiting (`memfit_cuda::Staging`); otherwise the copy is from
            /// ordinary memory and pins nothing.
            fn upload_with(&self, t: &Tensor, fill: &mut dyn FnMut(&mut [u8]), _staged: bool) -> Result<()> {
                with_host_buffer(t, fill, |bytes| self.write_bytes(t, bytes))
            }

            /// Pinned host bytes the device holds for uploads now, and the most it held.
            fn pinned_bytes(&self) -> (u64, u64) {
                (0, 0)
            }

            /// The work a GPU was asked for and how it was queued (Note [CUDA graphs] in
            /// memfit-cuda); None for cpu and meta.
            fn launches(&self) -> Option<memfit_cuda::Launches> {
                None
            }

            /// Which of its alternative kernels the device ran so far, as reports name them
            /// (`attention: tensor cores`, `bias: cuBLASLt epilogue`, ...); a GPU's only.
            fn kernels_used(&self) -> Vec<String> {
                Vec::new()
            }

            /// Takes the math library's workspace (`bytes` at device `address`, a block of the
            /// device's allocator held until it closes); only a GPU has one.
            fn use_library_workspace(&self, _address: u64, _bytes: u64) -> Result<()> {
                Ok(())
            }

            /// Takes (or, with None, gives back) the workspace a GPU's bf16 and fp16 products round
            /// their operands into (`memfit_cuda::rounded`: address and bytes, a block of the
            /// device's allocator held while its products are rounded); only a GPU has one.
            fn use_rounding_workspace(&self, _workspace: Option<(u64, u64)>) -> Result<()> {
                Ok(())
            }
        }

        /// The `meta` backend: allocation happens in the ops; nothing is computed.
        pub(crate) struct Meta;

        impl Backend for Meta {
            $( fn $name(&self $(, _: $ty)*) -> Result<()> { Ok(()) } )*
        }

        impl Backend for Cpu {
            $( fn $name(&self $(, $arg: $ty)*) -> Result<()> {
                Ok(memfit_cpu::kernels::$name($(cpu::Lower::lower($arg)?),*)?)
            } )*
        }
    };
}

use crate::ops::{Binary, Compare, Unary};
use crate::Products;

/// Fills an ordinary host buffer of `t`'s bytes (8-byte aligned) with `fill` and hands it to `copy`.
pub(crate) fn with_host_buffer(
    t: &Tensor,
    fill: &mut dyn FnMut(&mut [u8]),
    copy: impl FnOnce(&[u8]) -> Result<()>,
) -> Result<()> {
    let bytes = t.numel() * t.dtype().size();
    let mut words = vec![0u64; bytes.div_ceil(8)];
    // SAFETY: the byte view covers exactly the words' memory and lives no longer than they do.
    let buffer = unsafe { std::slice::from_raw_parts_mut(words.as_mut_ptr() as *mut u8, bytes) };
    fill(buffer);
    copy(buffer)
}

backends! {
    // Data movement.
    /// Fills a tensor's bytes with zeros.
    fn fill_zeros(&self, t: &Tensor);
    /// Fills a float tensor with one value.
    fn fill(&self, t: &Tensor, value: f64);
    /// Copies host bytes (the tensor's dtype, row-major) into a fresh contiguous tensor.
    fn write_bytes(&self, t: &Tensor, bytes: &[u8]);
    /// Copies the tensor's elements in row-major order (any layout) into host `bytes` (the tensor's
    /// dtype; exactly its size). Waits for the device: the one way a GPU's values reach the host.
    fn read_bytes(&self, t: &Tensor, bytes: &mut [u8]);
    /// Copies `src`'s elements, in row-major order, into `dst` (same shape and dtype).
    fn copy(&self, dst: &Tensor, src: &Tensor);
    /// Adds 1 to every element of the contiguous int64 tensor `t`, in place.
    fn count_up(&self, t: &Tensor);

    // Element-wise.
    /// `out = op(x)` (x contiguous).
    fn unary(&self, op: Unary, x: &Tensor, out: &Tensor);
    /// `out = op'(saved) * grad` for op's saved value (its output or input, or none for `neg`);
    /// `out` may be `grad` itself (in place).
    fn unary_backward(&self, op: Unary, saved: Option<&Tensor>, grad: &Tensor, out: &Tensor);
    /// `out = x * scale + shift` (x contiguous).
    fn affine(&self, x: &Tensor, scale: f64, shift: f64, out: &Tensor);
    /// `out = op(a, b)` over the broadcast shape of `out`.
    fn binary(&self, op: Binary, a: &Tensor, b: &Tensor, out: &Tensor);
    /// `dst += src` in place (same shape).
    fn add_into(&self, dst: &Tensor, src: &Tensor);
    /// `out = op(a, b)` as bools over the broadcast shape of the contiguous bool `out`.
    fn compare(&self, op: Compare, a: &Tensor, b: &Tensor, out: &Tensor);
    /// `out = cond ? a : b` over the broadcast shape of `out` (cond bool).
    fn select(&self, cond: &Tensor, a: &Tensor, b: &Tensor, out: &Tensor);
    /// `out = x ^ exponent` (x contiguous).
    fn pow_scalar(&self, x: &Tensor, exponent: f64, out: &Tensor);
    /// `out = grad * exponent * x ^ (exponent - 1)`; `out` may be `grad` itself.
    fn pow_scalar_backward(&self, x: &Tensor, exponent: f64, grad: &Tensor, out: &Tensor);
    /// `out = min(max(x, lo), hi)` (x contiguous).
    fn clamp(&self, x: &Tensor, lo: f64, hi: f64, out: &Tensor);
    /// `out = grad` where `x` is inside [lo, hi] (`inclusive`) or (lo, hi), else 0; `out` may be
    /// `grad` itself.
    fn clamp_backward(&self, x: &Tensor, lo: f64, hi: f64, inclusive: bool, grad: &Tensor, out: &Tensor);

    // Seam A: conv.
    /// 2-D convolution by the op's work plan `g`: `out = conv2d(x, weight) (+ bias)` (all
    /// contiguous), with the op's im2col workspace (none for a direct 1x1 convolution).
    fn conv2d(
        &self,
        g: &crate::ops::ConvGeom,
        x: &Tensor,
        weight: &Tensor,
        bias: Option<&Tensor>,
        out: &Tensor,
        workspace: Option<&Tensor>,
    );
    /// The conv2d gradients asked for (`dx`, `dw`, `db`) from the output gradient `grad`, with the
    /// op's workspaces (per-lane im2col and transposed-gradient tiles, per-lane weight partials).
    #[allow(clippy::too_many_arguments)]
    fn conv2d_backward(
        &self,
        g: &crate::ops::ConvGeom,
        x: &Tensor,
        weight: &Tensor,
        grad: &Tensor,
        dx: Option<&Tensor>,
        dw: Option<&Tensor>,
        db: Option<&Tensor>,
        partials: Option<&Tensor>,
        workspace: Option<&Tensor>,
    );

    // Seam A: pool.
    /// Max pooling into `out`, with flat int64 `indices` and the window `positions` (`width` bytes
    /// each) when given.
    fn max_pool2d(
        &self,
        g: &crate::ops::PoolGeom,
        x: &Tensor,
        out: &Tensor,
        indices: Option<&Tensor>,
        positions: Option<&Tensor>,
        width: usize,
    );
    /// `dx` = each output gradient credited to its saved window position (`dx` uninitialised).
    fn max_pool2d_backward(
        &self,
        g: &crate::ops::PoolGeom,
        width: usize,
        grad: &Tensor,
        positions: &Tensor,
        dx: &Tensor,
    );
    /// Fixed or adaptive average pooling into `out`.
    fn avg_pool2d(&self, g: &crate::ops::PoolGeom, kind: crate::ops::Avg, x: &Tensor, out: &Tensor);
    /// `dx` = each output gradient shared over its window (`dx` uninitialised).
    fn avg_pool2d_backward(&self, g: &crate::ops::PoolGeom, kind: crate::ops::Avg, grad: &Tensor, dx: &Tensor);

    // Seam A: dropout.
    /// `out = x * mask / (1 - p)`, the mask drawn from `seed`; its bits into `mask` when given.
    fn dropout(&self, x: &Tensor, p: f64, seed: u64, out: &Tensor, mask: Option<&Tensor>);
    /// `gx = grad * mask / (1 - p)` from the saved bit mask.
    fn dropout_backward(&self, grad: &Tensor, mask: &Tensor, p: f64, gx: &Tensor);

    // Seam A: embedding.
    /// `out[k] = weight[indices[k]]`; errors on an index outside the table.
    fn embedding(&self, indices: &Tensor, weight: &Tensor, out: &Tensor);
    /// `gw[indices[k]] += grad[k]` into the zeroed `gw`.
    fn embedding_backward(&self, indices: &Tensor, grad: &Tensor, gw: &Tensor, workspace: Option<&Tensor>);

    // Seam A: cast.
    /// `out = x` converted to `out`'s dtype (same shape, x contiguous).
    fn cast(&self, x: &Tensor, out: &Tensor);

    // Seam A: reduce.
    /// `out += x` summed down to `out`'s shape (a shape `x`'s broadcasts from); `out` is zeroed.
    fn sum_to_shape(&self, x: &Tensor, out: &Tensor);
    /// Sum (or mean) over the middle dim of x contiguous `[outer, size, inner]`.
    fn sum_dim(&self, x: &Tensor, outer: usize, size: usize, inner: usize, mean: bool, out: &Tensor);
    /// `out = grad * scale`, `grad` the upstream gradient expanded to `out`'s shape.
    fn sum_backward(&self, grad: &Tensor, scale: f64, out: &Tensor);
    /// Max over the middle dim of x contiguous `[outer, size, inner]`: `values` and int64 `indices`.
    fn max_dim(&self, x: &Tensor, outer: usize, size: usize, inner: usize, values: &Tensor, indices: &Tensor);
    /// `out[o, indices[o, i], i] += grad[o, i]` into the zeroed `out`.
    fn max_dim_backward(&self, grad: &Tensor, indices: &Tensor, outer: usize, size: usize, inner: usize, out: &Tensor);
    /// The max of all elements of x into the 0-d `out`.
    fn max_all(&self, x: &Tensor, out: &Tensor);
    /// The 0-d `grad` shared among the elements of x equal to `max`, into the zeroed `out`.
    fn max_all_backward(&self, x: &Tensor, max: &Tensor, grad: &Tensor, out: &Tensor);
    /// How many elements of the int64 tensors `a` and `b` (contiguous, same shape) are equal, into
    /// the int64 0-d `out`.
    fn count_equal(&self, a: &Tensor, b: &Tensor, out: &Tensor);

    // Seam A: optim.
    /// One SGD step in place on `param` (and `momentum_buffer`).
    fn sgd_update(&self, param: &Tensor, grad: &Tensor, momentum_buffer: Option<&Tensor>, step: crate::ops::SgdStep);
    /// One Adam / AdamW step in place on `param`, `exp_avg` and `exp_avg_sq`.
    fn adam_update(
        &self,
        param: &Tensor,
        grad: &Tensor,
        exp_avg: &Tensor,
        exp_avg_sq: &Tensor,
        step: crate::ops::AdamStep,
    );
    /// The same with f32 `param` and `grad` and bf16 moments (Note [Compact optimizer state]).
    fn adam_update_bf16_state(
        &self,
        param: &Tensor,
        grad: &Tensor,
        exp_avg: &Tensor,
        exp_avg_sq: &Tensor,
        step: crate::ops::AdamStep,
    );
    /// The same with 8-bit block-wise moments: u8 codes and an f32 absolute maximum per block.
    fn adam_update_8bit(
        &self,
        param: &Tensor,
        grad: &Tensor,
        m_codes: &Tensor,
        m_absmax: &Tensor,
        v_codes: &Tensor,
        v_absmax: &Tensor,
        step: crate::ops::AdamStep,
    );
    /// `grad *= inv_scale` in place; sets `found_inf` when a value is inf or NaN before or after.
    fn unscale(&self, grad: &Tensor, inv_scale: f64, found_inf: &mut bool);
    // Seam B: matmul.
    /// `out = a @ b` over the last two dims, the batch dims of `a` and `b` broadcast to `out`'s.
    fn matmul(&self, a: &Tensor, b: &Tensor, out: &Tensor, products: Products);
    /// `out = x W^T + b` (x contiguous [.., in], weight [out, in], bias contiguous [out]).
    fn linear(&self, x: &Tensor, weight: &Tensor, bias: Option<&Tensor>, out: &Tensor, products: Products);
    /// A linear layer's weight gradient `gw = grad^T x` (grad [rows, out], x [rows, in]) and, when
    /// given, its bias gradient `gb` (grad's column sums), from one pass over `grad`.
    fn linear_weight_grad(&self, grad: &Tensor, x: &Tensor, gw: &Tensor, gb: Option<&Tensor>, products: Products);
    /// `out = gelu(x) W^T + b`, a block of rows at a time through the op's `scratch` (as many rows as it
    /// holds: `GELU_ROWS` on the cpu, `GPU_FUSED_ROWS` on a GPU).
    fn gelu_linear(
        &self,
        x: &Tensor,
        weight: &Tensor,
        bias: Option<&Tensor>,
        scratch: &Tensor,
        out: &Tensor,
        products: Products,
    );
    /// gelu_linear's input gradient into `gx` (`x` itself when in place), weight gradient into `gw`
    /// and, with it, bias gradient into `gb`, each when given, from `grad` [rows, out], block by
    /// block through `scratch`. On a GPU target `x` may be its saved 16-bit copy, in the products'
    /// own format (the op layer's `saved_in_operand_format`), read as restoring it would give it.
    #[allow(clippy::too_many_arguments)]
    fn gelu_linear_backward(
        &self,
        x: &Tensor,
        weight: &Tensor,
        grad: &Tensor,
        gx: Option<&Tensor>,
        gw: Option<&Tensor>,
        gb: Option<&Tensor>,
        scratch: &Tensor,
        products: Products,
    );

    // Seam B: norm.
    /// `out = layer_norm(x)` over rows of `d` elements; the per-row mean and rstd into `mean` and
    /// `rstd` when given.
    #[allow(clippy::too_many_arguments)]
    fn layer_norm(
        &self,
        x: &Tensor,
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        d: usize,
        eps: f64,
        out: &Tensor,
        mean: Option<&Tensor>,
        rstd: Option<&Tensor>,
    );
    /// layer_norm's gradients (each when given) from its saved input, weight and statistics.
    #[allow(clippy::too_many_arguments)]
    fn layer_norm_backward(
        &self,
        x: &Tensor,
        weight: Option<&Tensor>,
        mean: &Tensor,
        rstd: &Tensor,
        d: usize,
        grad: &Tensor,
        gx: Option<&Tensor>,
        gw: Option<&Tensor>,
        gb: Option<&Tensor>,
    );
    /// `out = linear(layer_norm(x))`, a block of rows at a time through the op's `scratch` (as many rows
    /// as it holds: `LN_ROWS` on the cpu, `GPU_FUSED_ROWS` on a GPU); the
    /// per-row mean and rstd into `mean` and `rstd` when given.
    #[allow(clippy::too_many_arguments)]
    fn layer_norm_linear(
        &self,
        x: &Tensor,
        ln_weight: &Tensor,
        ln_bias: &Tensor,
        eps: f64,
        weight: &Tensor,
        bias: Option<&Tensor>,
        scratch: &Tensor,
        out: &Tensor,
        mean: Option<&Tensor>,
        rstd: Option<&Tensor>,
        products: Products,
    );
    /// layer_norm_linear's gradients (each when given; `gx` is `x` itself when in place; the linear
    /// bias gradient `gb` only with the weight gradient `gw`) from `grad` [rows, out], block by
    /// block through `scratch`, with f64 column `sums` [2, in] for the layer-norm weight and bias
    /// gradients. On a GPU target `x` may be its saved 16-bit copy, as in `gelu_linear_backward`.
    #[allow(clippy::too_many_arguments)]
    fn layer_norm_linear_backward(
        &self,
        x: &Tensor,
        ln_weight: &Tensor,
        ln_bias: &Tensor,
        weight: &Tensor,
        mean: &Tensor,
        rstd: &Tensor,
        grad: &Tensor,
        gx: Option<&Tensor>,
        glw: Option<&Tensor>,
        glb: Option<&Tensor>,
        gw: Option<&Tensor>,
        gb: Option<&Tensor>,
        scratch: &Tensor,
        sums: Option<&Tensor>,
        products: Products,
    );
    /// `out = batch_norm(x)` over channel dim 1 (batch statistics, updating the running ones when
    /// given, in training; the running ones in eval); the statistics used into `mean` and `rstd`
    /// when given.
    #[allow(clippy::too_many_arguments)]
    fn batch_norm(
        &self,
        x: &Tensor,
        running_mean: Option<&Tensor>,
        running_var: Option<&Tensor>,
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        training: bool,
        momentum: f64,
        eps: f64,
        out: &Tensor,
        mean: Option<&Tensor>,
        rstd: Option<&Tensor>,
    );
    /// batch_norm's gradients (each when given) from its saved input, weight and statistics.
    #[allow(clippy::too_many_arguments)]
    fn batch_norm_backward(
        &self,
        x: &Tensor,
        weight: Option<&Tensor>,
        mean: &Tensor,
        rstd: &Tensor,
        training: bool,
        grad: &Tensor,
        gx: Option<&Tensor>,
        gw: Option<&Tensor>,
        gb: Option<&Tensor>,
    );

    // Seam B: attention.
    /// Attention forward into `out` and, when given, the per-row log-sum-exp `lse`; `workspace`: a
    /// GPU's rounded copies of the operands (`ops::attention_bits`). On a GPU target q, k and v may
    /// be their saved 16-bit copies, which the tensor cores' kernels read in place (Note
    /// [Attention's saved operands]).
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        mask: Option<&Tensor>,
        pb: &crate::ops::AttnProblem,
        out: &Tensor,
        lse: Option<&Tensor>,
        workspace: Option<&Tensor>,
    );
    /// Attention backward's D of every query row, `rowsum(grad * out)`, into `delta` ([bh, tq]):
    /// `out` in `grad`'s dtype, or (an f32 `grad`) as half-precision storage saved it, in bf16 or
    /// f16, each element read as the f32 that restoring it gives.
    fn attention_delta(&self, out: &Tensor, grad: &Tensor, pb: &crate::ops::AttnProblem, delta: &Tensor);
    /// Attention backward from the output's gradient: q, k and v gradients, each when given (the
    /// packed op passes its one gradient three times), with the rows' D (`attention_delta`; the
    /// cpu reads it only for q's or k's gradient, a GPU always); `workspace` as the forward's, with
    /// the output's gradient's copy too.
    #[allow(clippy::too_many_arguments)]
    fn attention_backward(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        mask: Option<&Tensor>,
        lse: &Tensor,
        pb: &crate::ops::AttnProblem,
        grad: &Tensor,
        delta: Option<&Tensor>,
        gq: Option<&Tensor>,
        gk: Option<&Tensor>,
        gv: Option<&Tensor>,
        workspace: Option<&Tensor>,
    );

    // Seam B: loss.
    /// cross_entropy's mean loss into the scalar `out` (checks the targets' range).
    fn cross_entropy(&self, logits: &Tensor, target: &Tensor, label_smoothing: f64, out: &Tensor, workspace: Option<&Tensor>);
    /// cross_entropy's logits gradient from the scalar `grad`.
    fn cross_entropy_backward(&self, logits: &Tensor, target: &Tensor, label_smoothing: f64, grad: &Tensor, gx: &Tensor);
    /// `cross_entropy` and `cross_entropy_backward` of the same logits at once (a GPU reads them
    /// fewer times); with `bias_grad`, also the gradient's column sums into it (a head's bias
    /// gradient, summed as `linear_weight_grad` sums it). A 16-bit `gx` of f32 logits (a GPU's,
    /// under products that round f32 to it) receives the gradient as those products' operand bits,
    /// and the logits then hold the f32 gradient where `bias_grad` is summed from it. With
    /// `predicted` (int64 [N]), each row's class as `max_dim` finds it (the first index of the
    /// largest logit, or of the first NaN), read before the logits are written over.
    #[allow(clippy::too_many_arguments)]
    fn cross_entropy_with_grad(
        &self,
        logits: &Tensor,
        target: &Tensor,
        label_smoothing: f64,
        out: &Tensor,
        workspace: Option<&Tensor>,
        grad: &Tensor,
        gx: &Tensor,
        bias_grad: Option<&Tensor>,
        predicted: Option<&Tensor>,
    );
    /// nll_loss's mean into the scalar `out` (log_probs may be strided; checks the targets' range).
    fn nll_loss(&self, log_probs: &Tensor, target: &Tensor, out: &Tensor);
    /// nll_loss's gradient into the zero-filled `gx` [N, C] from the scalar `grad`.
    fn nll_loss_backward(&self, target: &Tensor, grad: &Tensor, gx: &Tensor);
    /// mse_loss's mean into the scalar `out`.
    fn mse_loss(&self, input: &Tensor, target: &Tensor, out: &Tensor);
    /// mse_loss's gradients of input and target (each when given) from the scalar `grad`.
    fn mse_loss_backward(&self, input: &Tensor, target: &Tensor, grad: &Tensor, ga: Option<&Tensor>, gb: Option<&Tensor>);

    // Seam B: softmax.
    /// `out = softmax(x)` (or log_softmax) over `dim` (x contiguous).
    fn softmax(&self, x: &Tensor, dim: usize, log: bool, out: &Tensor);
    /// softmax's (or log_softmax's) input gradient from its saved output `out` and `grad`.
    fn softmax_backward(&self, out: &Tensor, grad: &Tensor, dim: usize, log: bool, gx: &Tensor);
}

/// What opening a device gives: where its segments come from, its kernels, and for a GPU what it
/// is, the bytes its context took and the memory free after it.
pub(crate) struct Opened {
    pub segments: Box<dyn SegmentBackend>,
    pub kernels: Box<dyn Backend>,
    pub description: Option<String>,
    pub context_bytes: Option<u64>,
    pub free_bytes: Option<u64>,
}

/// Opens the memory and kernels of a device kind (the one place they are chosen).
pub(crate) fn open(kind: DeviceKind) -> Result<Opened> {
    Ok(match kind {
        DeviceKind::Cpu => Opened {
            segments: Box::new(HostBackend::default()),
            kernels: Box::new(Cpu),
            description: None,
            context_bytes: None,
            free_bytes: None,
        },
        DeviceKind::Meta(_) => Opened {
            segments: Box::new(MetaBackend),
            kernels: Box::new(Meta),
            description: None,
            context_bytes: None,
            free_bytes: None,
        },
        DeviceKind::Cuda(ordinal) => cuda::open(ordinal)?,
    })
}
