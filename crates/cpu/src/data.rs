//! CPU kernels that move data: zero and value fills, host bytes in and out, tensor-to-tensor copies.

use crate::error::Result;
use crate::view::View;
use crate::with_float;

pub fn fill_zeros(t: View<'_>) -> Result<()> {
    t.bytes_mut()?.fill(0);
    Ok(())
}

/// Sets every element of `t` (any layout: a view of a larger tensor is written where it lies) to
/// `value`.
pub fn fill(t: View<'_>, value: f64) -> Result<()> {
    if t.is_contiguous() {
        with_float!(t.dtype(), "full", T => t.slice_mut::<T>()?.fill(<T as crate::dtype::Float>::of(value)));
        return Ok(());
    }
    with_float!(t.dtype(), "fill_", T => {
        let v = <T as crate::dtype::Float>::of(value);
        let base = t.storage_ptr() as *mut T;
        let len = t.storage::<T>()?.len();
        t.layout().for_each_offset(|o| {
            if o < len {
                // SAFETY: `o` is an element offset of the view inside its storage (checked), which
                // the kernel updates exclusively (module docs).
                unsafe { *base.add(o) = v };
            }
        });
    });
    Ok(())
}

/// Adds 1 to every element of an int64 tensor, in place.
pub fn count_up(t: View<'_>) -> Result<()> {
    t.slice_mut::<i64>()?.iter_mut().for_each(|v| *v += 1);
    Ok(())
}

pub fn write_bytes(t: View<'_>, bytes: &[u8]) -> Result<()> {
    t.bytes_mut()?.copy_from_slice(bytes);
    Ok(())
}

/// The tensor's elements in row-major order (any layout) into host `bytes`.
pub fn read_bytes(t: View<'_>, bytes: &mut [u8]) -> Result<()> {
    t.copy_into_bytes(bytes)
}

pub fn copy(dst: View<'_>, src: View<'_>) -> Result<()> {
    src.copy_into_bytes(dst.bytes_mut()?)
}
