//! Who does what across ranks: the samples of a window each rank takes, and which rank owns which
//! parameter's optimizer state (ZeRO stage 1). Pure functions of sizes, the same on every rank.

use std::ops::Range;

/// The positions of a window of `n` samples that rank `rank` of `size` takes: contiguous, disjoint,
/// covering `0..n`, the first `n % size` ranks one sample more than the others.
pub fn shard(n: usize, rank: usize, size: usize) -> Range<usize> {
    let size = size.max(1);
    let (base, extra) = (n / size, n % size);
    let start = rank * base + rank.min(extra);
    let len = base + usize::from(rank < extra);
    start.min(n)..(start + len).min(n)
}

/// The rank that owns each parameter's optimizer state, from the parameters' element counts: the
/// largest parameter first, each to the rank holding the fewest elements so far (the lowest rank on a
/// tie), as PyTorch's `ZeroRedundancyOptimizer` balances its partitions.
pub fn owners(numels: &[usize], size: usize) -> Vec<usize> {
    let size = size.max(1);
    let mut order: Vec<usize> = (0..numels.len()).collect();
    order.sort_by(|&a, &b| numels[b].cmp(&numels[a]).then(a.cmp(&b)));
    let mut load = vec![0usize; size];
    let mut owner = vec![0; numels.len()];
    for i in order {
        let rank = (0..size).min_by_key(|&r| (load[r], r)).unwrap_or(0);
        load[rank] += numels[i];
        owner[i] = rank;
    }
    owner
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

    #[test]
    fn owners_balance_elements_largest_first() {
        assert_eq!(owners(&[10, 1, 1, 8], 2), vec![0, 1, 1, 1]);
        assert_eq!(owners(&[5, 5, 5, 5], 2), vec![0, 1, 0, 1]);
        assert_eq!(owners(&[3, 3], 1), vec![0, 0]);
        assert_eq!(owners(&[7], 3), vec![0]);
        // Every rank's load within the largest parameter of the others'.
        let numels = [65536, 256, 256, 768 * 256, 256 * 768, 768, 256, 256, 1024 * 256, 256 * 1024, 1024, 256];
        let own = owners(&numels, 2);
        let load = |r| numels.iter().zip(&own).filter(|(_, &o)| o == r).map(|(n, _)| n).sum::<usize>();
        assert!(load(0).abs_diff(load(1)) <= *numels.iter().max().unwrap(), "{} vs {}", load(0), load(1));
    }
}
