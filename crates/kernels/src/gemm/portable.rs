//! The portable micro-kernel: plain Rust over a 4 x 8 tile, for any scalar and any CPU (the
//! compiler vectorizes it for the baseline target).

use super::{GemmScalar, MicroKernel, Start};

const MR: usize = 4;
const NR: usize = 8;

pub(crate) fn kernel<T: GemmScalar>() -> MicroKernel<T> {
    // Reads B in place: the slowest level's speed matters little, and this way the driver's in-place
    // path runs (and is tested) on every CPU.
    MicroKernel { mr: MR, nr: NR, run: run::<T>, run_direct: None, pack_lines: None, b_in_place: true }
}

/// # Safety
/// `a` holds MR elements at each of `kc` steps `lda` apart, `b` NR elements at each of `kc` steps
/// `ldb` apart; `c` is valid for an MR x NR tile.
#[allow(clippy::too_many_arguments)]
unsafe fn run<T: GemmScalar>(
    kc: usize,
    a: *const T,
    lda: isize,
    b: *const T,
    ldb: isize,
    c: *mut T,
    rs_c: isize,
    start: Start<T>,
) {
    let mut acc = [[T::default(); NR]; MR];
    for p in 0..kc {
        let ap = std::slice::from_raw_parts(a.offset(p as isize * lda), MR);
        let bp = std::slice::from_raw_parts(b.offset(p as isize * ldb), NR);
        for i in 0..MR {
            for j in 0..NR {
                acc[i][j] = acc[i][j] + ap[i] * bp[j];
            }
        }
    }
    for (i, row) in acc.iter().enumerate() {
        let cr = c.offset(i as isize * rs_c);
        for (j, &v) in row.iter().enumerate() {
            let dst = cr.add(j);
            *dst = match start {
                Start::Zero => v,
                Start::Accumulate => *dst + v,
                Start::Bias(b) => v + *b.add(j),
            };
        }
    }
}
