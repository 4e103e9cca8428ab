//! [`Layout`]: shapes, strides and offsets (in elements), and the strided walks kernels make over
//! them. The shape rules that can fail (broadcasting two shapes, resolving a dim) are the tensor
//! crate's, which checks them before a kernel runs.

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    shape: Vec<usize>,
    strides: Vec<usize>,
    offset: usize,
}

/// Row-major strides of `shape`. Saturating: only an empty tensor's dims can multiply past
/// `usize` (the tensor crate checks every other shape's element count), and its strides address
/// nothing.
pub fn contiguous_strides(shape: &[usize]) -> Vec<usize> {
    let mut strides = vec![0; shape.len()];
    let mut acc: usize = 1;
    for (stride, &dim) in strides.iter_mut().zip(shape).rev() {
        *stride = acc;
        acc = acc.saturating_mul(dim.max(1));
    }
    strides
}

impl Layout {
    pub fn contiguous(shape: &[usize]) -> Self {
        Layout { shape: shape.to_vec(), strides: contiguous_strides(shape), offset: 0 }
    }

    pub fn new(shape: Vec<usize>, strides: Vec<usize>, offset: usize) -> Self {
        Layout { shape, strides, offset }
    }

    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    pub fn strides(&self) -> &[usize] {
        &self.strides
    }

    pub fn offset(&self) -> usize {
        self.offset
    }

    pub fn rank(&self) -> usize {
        self.shape.len()
    }

    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// True when elements are laid out in row-major order without gaps.
    pub fn is_contiguous(&self) -> bool {
        if self.numel() == 0 {
            return true;
        }
        let mut expected = 1;
        for (&dim, &stride) in self.shape.iter().zip(&self.strides).rev() {
            if dim != 1 && stride != expected {
                return false;
            }
            expected *= dim;
        }
        true
    }

    /// Element offset of each element in row-major order (for strided copies).
    pub fn for_each_offset(&self, mut f: impl FnMut(usize)) {
        let rank = self.rank();
        let numel = self.numel();
        if numel == 0 {
            return;
        }
        if rank == 0 {
            f(self.offset);
            return;
        }
        let inner = self.shape[rank - 1];
        let inner_stride = self.strides[rank - 1];
        let mut index = vec![0usize; rank - 1];
        let mut base = self.offset;
        loop {
            for i in 0..inner {
                f(base + i * inner_stride);
            }
            // Advance the outer multi-index.
            let mut d = rank - 1;
            loop {
                if d == 0 {
                    return;
                }
                d -= 1;
                index[d] += 1;
                base += self.strides[d];
                if index[d] < self.shape[d] {
                    break;
                }
                base -= self.strides[d] * self.shape[d];
                index[d] = 0;
            }
        }
    }
}

/// Calls `f(offset_a, offset_b)` for each element of two same-shaped layouts, in row-major order.
/// (Broadcast operands are passed as expanded layouts with stride 0.)
pub fn for_each_offset_pair(a: &Layout, b: &Layout, mut f: impl FnMut(usize, usize)) {
    for_each_offsets([a, b], |[oa, ob]| f(oa, ob));
}

/// Calls `f(offset_a, offset_b, len)` for runs of `len` elements that follow one another in both
/// same-shaped layouts (stride 1), in row-major order: the trailing dimensions that are one run in
/// both go together (a channel slice of an NCHW tensor: a run per sample), else runs of one.
/// The elements and their order are [`for_each_offset_pair`]'s.
pub fn for_each_run_pair(a: &Layout, b: &Layout, mut f: impl FnMut(usize, usize, usize)) {
    let rank = a.rank();
    if a.numel() == 0 {
        return;
    }
    if rank == 0 || a.strides[rank - 1] != 1 || b.strides[rank - 1] != 1 {
        return for_each_offset_pair(a, b, |oa, ob| f(oa, ob, 1));
    }
    // Dimensions d.. are one run of `len` in both.
    let (mut d, mut len) = (rank - 1, a.shape[rank - 1]);
    while d > 0 && a.strides[d - 1] == len && b.strides[d - 1] == len {
        d -= 1;
        len *= a.shape[d];
    }
    let outer = |l: &Layout| Layout::new(l.shape[..d].to_vec(), l.strides[..d].to_vec(), l.offset);
    for_each_offset_pair(&outer(a), &outer(b), |oa, ob| f(oa, ob, len));
}

/// Calls `f(offset_a, offset_b, offset_c)` for each element of three same-shaped layouts, in
/// row-major order (broadcast operands as for [`for_each_offset_pair`]).
pub fn for_each_offset_triple(a: &Layout, b: &Layout, c: &Layout, mut f: impl FnMut(usize, usize, usize)) {
    for_each_offsets([a, b, c], |[oa, ob, oc]| f(oa, ob, oc));
}

/// Calls `f` with each element's offset in each of `N` same-shaped layouts, in row-major order.
fn for_each_offsets<const N: usize>(layouts: [&Layout; N], mut f: impl FnMut([usize; N])) {
    let first = layouts[0];
    debug_assert!(layouts.iter().all(|l| l.shape == first.shape));
    let rank = first.rank();
    if first.numel() == 0 {
        return;
    }
    let mut base = layouts.map(|l| l.offset);
    if rank == 0 {
        f(base);
        return;
    }
    let inner = first.shape[rank - 1];
    let step = layouts.map(|l| l.strides[rank - 1]);
    let mut index = vec![0usize; rank - 1];
    loop {
        for i in 0..inner {
            f(std::array::from_fn(|k| base[k] + i * step[k]));
        }
        let mut d = rank - 1;
        loop {
            if d == 0 {
                return;
            }
            d -= 1;
            index[d] += 1;
            for (b, l) in base.iter_mut().zip(&layouts) {
                *b += l.strides[d];
            }
            if index[d] < first.shape[d] {
                break;
            }
            for (b, l) in base.iter_mut().zip(&layouts) {
                *b -= l.strides[d] * l.shape[d];
            }
            index[d] = 0;
        }
    }
}

/// The layout of `l` broadcast to `shape` (stride 0 on broadcast dims). `shape` must be a valid
/// broadcast target of `l`'s shape.
pub fn broadcast_layout(l: &Layout, shape: &[usize]) -> Layout {
    let lead = shape.len() - l.rank();
    let strides = (0..shape.len())
        .map(|i| if i < lead || l.shape[i - lead] != shape[i] { 0 } else { l.strides[i - lead] })
        .collect();
    Layout::new(shape.to_vec(), strides, l.offset)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offsets_follow_strides() {
        let l = Layout::new(vec![2, 3], vec![1, 2], 1);
        let mut seen = vec![];
        l.for_each_offset(|o| seen.push(o));
        assert_eq!(seen, vec![1, 3, 5, 2, 4, 6]);
        assert!(!l.is_contiguous());
        assert!(Layout::contiguous(&[2, 1, 3]).is_contiguous());
        assert!(Layout::new(vec![2, 0], vec![1, 1], 0).is_contiguous(), "empty tensors are contiguous");
    }

    /// Runs cover the elements of `for_each_offset_pair`, in its order: a channel slice of an NCHW
    /// tensor against a contiguous one, a transposed view, a broadcast one, a scalar and an empty one.
    #[test]
    fn runs_are_the_offset_pairs_taken_together() {
        let slice = Layout::new(vec![2, 3, 4, 5], vec![120, 20, 5, 1], 40);
        let cases = [
            (slice.clone(), Layout::contiguous(&[2, 3, 4, 5]), 2),
            (Layout::contiguous(&[2, 3, 4, 5]), slice, 2),
            (Layout::new(vec![3, 4], vec![1, 3], 0), Layout::contiguous(&[3, 4]), 12),
            (Layout::contiguous(&[3, 4]), Layout::new(vec![3, 4], vec![0, 1], 2), 3),
            (Layout::contiguous(&[2, 1, 6]), Layout::new(vec![2, 1, 6], vec![6, 99, 1], 0), 2),
            (Layout::new(vec![], vec![], 7), Layout::new(vec![], vec![], 3), 1),
            (Layout::contiguous(&[2, 0, 3]), Layout::contiguous(&[2, 0, 3]), 0),
        ];
        for (a, b, runs) in cases {
            let mut want = vec![];
            for_each_offset_pair(&a, &b, |x, y| want.push((x, y)));
            let (mut got, mut count) = (vec![], 0);
            for_each_run_pair(&a, &b, |x, y, len| {
                count += 1;
                got.extend((0..len).map(|i| (x + i, y + i)));
            });
            assert_eq!(got, want, "{a:?} {b:?}");
            assert_eq!(count, runs, "{a:?} {b:?}");
        }
    }
}
