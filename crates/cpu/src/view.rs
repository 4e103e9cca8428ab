//! [`View`]: what a kernel sees of a tensor — the storage's bytes, the dtype and the layout — and
//! the typed slices it reads and writes through.
//!
//! Aliasing: kernels read inputs through `&[T]` and write outputs through `&mut [T]` made from one
//! storage pointer. That is sound because of how the tensor crate issues ops (its Note [Storage
//! aliasing], `tensor/src/tensor.rs`): an op writes only storage it has just allocated, or
//! parameter, gradient and state storage that nothing else borrows during the update.

use crate::dtype::{DType, Element};
use crate::error::{Error, Result};
use crate::layout::Layout;

/// A tensor as a kernel sees it: `bytes` bytes of storage from `base`, read as `dtype` through
/// `layout` (offsets in elements).
#[derive(Clone, Copy)]
pub struct View<'a> {
    base: *mut u8,
    bytes: usize,
    dtype: DType,
    layout: &'a Layout,
}

// SAFETY: a view is a shared description of storage that lives for 'a; the data it hands out obeys
// the aliasing rule of the module docs on any thread, as the tensor it came from did.
unsafe impl Send for View<'_> {}
unsafe impl Sync for View<'_> {}

impl<'a> View<'a> {
    /// A view of `bytes` bytes of storage at `base`.
    ///
    /// # Safety
    /// `base` must be valid for reads and writes of `bytes` bytes for 'a, aligned for `dtype`, and
    /// hold initialised elements of `dtype`; every element `layout` addresses must lie inside; and
    /// the storage must be used by the aliasing rule of the module docs.
    pub unsafe fn new(base: *mut u8, bytes: usize, dtype: DType, layout: &'a Layout) -> Self {
        View { base, bytes, dtype, layout }
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    pub fn layout(&self) -> &'a Layout {
        self.layout
    }

    pub fn shape(&self) -> &'a [usize] {
        self.layout.shape()
    }

    pub fn numel(&self) -> usize {
        self.layout.numel()
    }

    pub fn rank(&self) -> usize {
        self.layout.rank()
    }

    pub fn is_contiguous(&self) -> bool {
        self.layout.is_contiguous()
    }

    fn check_dtype(&self, want: DType) -> Result<()> {
        if self.dtype != want {
            return Err(Error::dtype(format!("tensor is {}, asked as {}", self.dtype, want)));
        }
        Ok(())
    }

    fn check_contiguous(&self) -> Result<()> {
        if !self.is_contiguous() {
            return Err(Error::invalid("internal: kernel given a non-contiguous tensor"));
        }
        Ok(())
    }

    /// True when both views are of the same elements (the same storage and layout): a kernel given
    /// one tensor twice, or an output that is its input.
    pub fn same(&self, other: View<'_>) -> bool {
        self.base == other.base && self.layout == other.layout
    }

    /// The value of a one-element view.
    pub fn scalar<T: Element>(&self) -> Result<T> {
        if self.numel() != 1 {
            return Err(Error::invalid(format!("internal: kernel wanted one element, got shape {:?}", self.shape())));
        }
        Ok(self.storage::<T>()?[self.layout.offset()])
    }

    /// The elements of a contiguous view.
    pub fn slice<T: Element>(&self) -> Result<&'a [T]> {
        self.check_dtype(T::DTYPE)?;
        self.check_contiguous()?;
        // SAFETY: `new`'s contract: the storage holds the layout's elements of T from its offset,
        // aligned, for 'a; no mutable alias exists meanwhile (module docs).
        Ok(unsafe { std::slice::from_raw_parts((self.base as *const T).add(self.layout.offset()), self.numel()) })
    }

    /// The elements of a contiguous view, for writing.
    #[allow(clippy::mut_from_ref)]
    pub fn slice_mut<T: Element>(&self) -> Result<&'a mut [T]> {
        self.check_dtype(T::DTYPE)?;
        self.check_contiguous()?;
        // SAFETY: as in `slice`; the kernel writes only fresh outputs or exclusively updated
        // storage (module docs).
        Ok(unsafe { std::slice::from_raw_parts_mut((self.base as *mut T).add(self.layout.offset()), self.numel()) })
    }

    /// The elements of a contiguous view as bytes, for dtype-agnostic fills and copies.
    #[allow(clippy::mut_from_ref)]
    pub fn bytes_mut(&self) -> Result<&'a mut [u8]> {
        self.check_contiguous()?;
        let size = self.dtype.size();
        // SAFETY: as in `slice_mut`, in bytes.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.base.add(self.layout.offset() * size), self.numel() * size) })
    }

    /// The storage's base pointer, for strided writes through the layout (module docs).
    pub fn storage_ptr(&self) -> *mut u8 {
        self.base
    }

    /// All of the storage's bytes, for strided reads through the layout.
    pub fn storage_bytes(&self) -> &'a [u8] {
        // SAFETY: `new`'s contract: `bytes` readable bytes for 'a.
        unsafe { std::slice::from_raw_parts(self.base, self.bytes) }
    }

    /// All elements of the storage as `T`, for strided reads through the layout.
    pub fn storage<T: Element>(&self) -> Result<&'a [T]> {
        self.check_dtype(T::DTYPE)?;
        // SAFETY: `new`'s contract: the storage is aligned for and holds elements of T.
        Ok(unsafe { std::slice::from_raw_parts(self.base as *const T, self.bytes / std::mem::size_of::<T>()) })
    }

    /// Writes the elements, in row-major order (any layout), into `dst` (exactly numel * size bytes).
    pub fn copy_into_bytes(&self, dst: &mut [u8]) -> Result<()> {
        let size = self.dtype.size();
        let bytes = self.storage_bytes();
        if dst.len() != self.numel() * size {
            return Err(Error::invalid("internal: copy destination has the wrong size"));
        }
        if self.is_contiguous() {
            let start = self.layout.offset() * size;
            dst.copy_from_slice(&bytes[start..start + dst.len()]);
            return Ok(());
        }
        // Row by row (a row: the innermost dimension), rows in parallel when there is much to copy;
        // a row whose elements are adjacent is one memcpy (a transposed view of the outer dims: the
        // attention's head splits and their gradients).
        let (shape, strides) = (self.layout.shape(), self.layout.strides());
        let rank = shape.len();
        let (inner, inner_stride) = (shape[rank - 1], strides[rank - 1]);
        let row_bytes = inner * size;
        if row_bytes == 0 {
            return Ok(());
        }
        let offset = self.layout.offset();
        // Element offset of the first element of row `r` (rows in row-major order).
        let row_start = |mut r: usize| {
            let mut o = offset;
            for d in (0..rank - 1).rev() {
                o += (r % shape[d]) * strides[d];
                r /= shape[d];
            }
            o
        };
        let copy_row = |(r, out): (usize, &mut [u8])| {
            let start = row_start(r);
            if inner_stride == 1 {
                out.copy_from_slice(&bytes[start * size..start * size + row_bytes]);
            } else {
                for (i, chunk) in out.chunks_exact_mut(size).enumerate() {
                    let o = (start + i * inner_stride) * size;
                    chunk.copy_from_slice(&bytes[o..o + size]);
                }
            }
        };
        if dst.len() >= 1 << 20 {
            use rayon::prelude::*;
            dst.par_chunks_mut(row_bytes).enumerate().for_each(copy_row);
        } else {
            dst.chunks_mut(row_bytes).enumerate().for_each(copy_row);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A view of `data` through `layout`.
    fn view<'a>(data: &'a mut [f32], layout: &'a Layout) -> View<'a> {
        // SAFETY: `data` outlives the view, is aligned for f32 and holds every element the test
        // layouts address; nothing else borrows it meanwhile.
        unsafe { View::new(data.as_mut_ptr() as *mut u8, std::mem::size_of_val(data), DType::F32, layout) }
    }

    /// Strided copies, row by row (adjacent rows in one copy, rows in parallel when large), give
    /// the elements in row-major order through the layout: transposes, broadcasts, an offset, rank 0.
    #[test]
    fn strided_copies_follow_the_layout_element_by_element() {
        let mut data: Vec<f32> = (0..400_000).map(|i| i as f32).collect();
        let layouts = [
            Layout::new(vec![3, 4], vec![1, 3], 0),
            Layout::new(vec![2, 3, 4], vec![12, 1, 3], 5),
            Layout::new(vec![2, 3, 4], vec![4, 8, 1], 1),
            Layout::new(vec![5, 7], vec![0, 1], 2),
            Layout::new(vec![6, 1, 3], vec![3, 9, 0], 0),
            Layout::new(vec![], vec![], 7),
            // Over 1 MiB: the parallel path, adjacent rows and strided ones.
            Layout::new(vec![64, 32, 128], vec![128, 8192, 1], 0),
            Layout::new(vec![64, 128, 32], vec![4096, 1, 128], 3),
        ];
        for layout in &layouts {
            let v = view(&mut data, layout);
            let mut want = Vec::new();
            layout.for_each_offset(|o| want.push((o as f32).to_ne_bytes()));
            let mut got = vec![0u8; layout.numel() * 4];
            v.copy_into_bytes(&mut got).unwrap();
            assert_eq!(got, want.concat(), "{layout:?}");
        }
    }

    #[test]
    fn slices_check_dtype_and_contiguity_and_start_at_the_offset() {
        let mut data = [0.0, 1.0, 2.0, 3.0, 4.0, 5.0];
        let row = Layout::new(vec![2], vec![1], 3);
        let v = view(&mut data, &row);
        assert_eq!(v.slice::<f32>().unwrap(), &[3.0, 4.0]);
        v.slice_mut::<f32>().unwrap()[1] = 9.0;
        assert_eq!(v.bytes_mut().unwrap(), [3.0f32.to_ne_bytes(), 9.0f32.to_ne_bytes()].concat());
        let mut copied = [0u8; 8];
        v.copy_into_bytes(&mut copied).unwrap();
        assert_eq!(
            copied[..],
            [3.0f32.to_ne_bytes(), 9.0f32.to_ne_bytes()].concat(),
            "a contiguous copy from the offset"
        );
        assert!(matches!(v.slice::<f64>(), Err(Error::DType(_))));
        assert_eq!(v.storage::<f32>().unwrap().len(), 6);
        let column = Layout::new(vec![2], vec![3], 1);
        let c = view(&mut data, &column);
        assert!(matches!(c.slice::<f32>(), Err(Error::Invalid(_))));
        assert!(matches!(c.slice_mut::<f32>(), Err(Error::Invalid(_))));
        assert!(c.bytes_mut().is_err());
        assert_eq!((c.rank(), c.numel(), c.shape()), (1, 2, &[2usize][..]));
    }

    #[test]
    fn strided_copies_walk_the_layout_in_row_major_order() {
        let mut data = [0.0f32, 1.0, 2.0, 3.0, 4.0, 5.0];
        let transposed = Layout::new(vec![3, 2], vec![1, 3], 0);
        let t = view(&mut data, &transposed);
        let mut out = [0u8; 24];
        t.copy_into_bytes(&mut out).unwrap();
        let got: Vec<f32> = out.chunks(4).map(|b| f32::from_ne_bytes(b.try_into().unwrap())).collect();
        assert_eq!(got, [0.0, 3.0, 1.0, 4.0, 2.0, 5.0]);
        assert!(t.copy_into_bytes(&mut [0u8; 20]).is_err(), "a destination of the wrong size");
    }

    #[test]
    fn same_means_the_same_elements_and_scalar_one_element() {
        let mut data = [7.0f32, 8.0];
        let base = data.as_mut_ptr() as *mut u8;
        let (first, second) = (Layout::new(vec![], vec![], 0), Layout::new(vec![], vec![], 1));
        // SAFETY: as in `view`; both views address elements of `data`.
        let (a, b) = unsafe { (View::new(base, 8, DType::F32, &first), View::new(base, 8, DType::F32, &second)) };
        assert!(a.same(a) && !a.same(b));
        assert_eq!((a.scalar::<f32>().unwrap(), b.scalar::<f32>().unwrap()), (7.0, 8.0));
        let pair = Layout::new(vec![2], vec![1], 0);
        // SAFETY: as above.
        let p = unsafe { View::new(base, 8, DType::F32, &pair) };
        assert!(p.scalar::<f32>().is_err(), "two elements are not a scalar");
        assert_eq!(p.storage_bytes().len(), 8);
        assert_eq!(p.storage_ptr(), base);
    }
}
