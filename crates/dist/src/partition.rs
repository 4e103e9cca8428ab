//! Who does what across ranks: the contiguous share of `n` items each rank takes (the samples of a
//! window; under ZeRO-1 the parameters' flattened elements whose optimizer state it keeps). A pure
//! function of sizes, the same on every rank.

use std::ops::Range;

/// The positions of `n` items (a window's samples, the parameters' elements) that rank `rank` of `size` takes: contiguous, disjoint,
/// covering `0..n`, the first `n % size` ranks one sample more than the others.
pub fn shard(n: usize, rank: usize, size: usize) -> Range<usize> {
    let size = size.max(1);
    let (base, extra) = (n / size, n % size);
    let start = rank * base + rank.min(extra);
    let len = base + usize::from(rank < extra);
    start.min(n)..(start + len).min(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_cover_a_window_once_and_differ_by_at_most_one() {
        for n in 0..40 {
            for size in 1..6 {
                let shards: Vec<_> = (0..size).map(|r| shard(n, r, size)).collect();
                let mut next = 0;
                for s in &shards {
                    assert_eq!(s.start, next, "n {n} size {size}: {shards:?}");
                    next = s.end;
                }
                assert_eq!(next, n);
                let lens: Vec<usize> = shards.iter().map(|s| s.len()).collect();
                assert!(lens.iter().max().unwrap() - lens.iter().min().unwrap() <= 1, "{lens:?}");
                assert!(lens.windows(2).all(|w| w[0] >= w[1]), "larger shards first: {lens:?}");
            }
        }
        assert_eq!(shard(10, 0, 3), 0..4);
        assert_eq!(shard(10, 1, 3), 4..7);
        assert_eq!(shard(10, 2, 3), 7..10);
    }
}
