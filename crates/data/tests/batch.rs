//! Epoch order, batches, normalization and `fill_batch`.

mod common;

use common::{images, labels};
use memfit_data::*;
use proptest::prelude::*;

fn is_permutation(order: &[usize], len: usize) -> bool {
    let mut seen = vec![false; len];
    order.len() == len && order.iter().all(|&i| i < len && !std::mem::replace(&mut seen[i], true))
}

#[test]
fn order_is_deterministic_per_seed_and_epoch() {
    let a = EpochOrder::new(1000, 42, 3, true);
    let b = EpochOrder::new(1000, 42, 3, true);
    assert_eq!(a, b);
}

#[test]
fn order_differs_across_seeds_and_epochs() {
    let base = EpochOrder::new(1000, 42, 0, true);
    assert_ne!(base.indices(), EpochOrder::new(1000, 43, 0, true).indices());
    assert_ne!(base.indices(), EpochOrder::new(1000, 42, 1, true).indices());
    assert_ne!(base.indices(), (0..1000).collect::<Vec<_>>().as_slice());
    // Epoch e of seed s is not epoch e+1 of seed s-1 or similar trivial overlaps.
    assert_ne!(EpochOrder::new(1000, 1, 0, true), EpochOrder::new(1000, 0, 1, true));
}

#[test]
fn every_index_exactly_once_per_epoch() {
    for epoch in 0..5 {
        let o = EpochOrder::new(777, 9, epoch, true);
        assert!(is_permutation(o.indices(), 777));
        let flat: Vec<usize> = o.batches(64).flatten().copied().collect();
        assert!(is_permutation(&flat, 777));
    }
}

#[test]
fn no_shuffle_is_identity() {
    let o = EpochOrder::new(10, 5, 7, false);
    assert_eq!(o.indices(), &[0, 1, 2, 3, 4, 5, 6, 7, 8, 9]);
    assert!(EpochOrder::new(0, 1, 1, true).is_empty());
}

#[test]
fn last_partial_batch_is_kept() {
    let o = EpochOrder::new(10, 0, 0, false);
    let batches: Vec<&[usize]> = o.batches(4).collect();
    assert_eq!(batches, vec![&[0, 1, 2, 3][..], &[4, 5, 6, 7][..], &[8, 9][..]]);
    assert_eq!(o.num_batches(4), 3);
    assert_eq!(o.batches(4).len(), 3);
    assert_eq!(o.num_batches(5), 2);
    assert_eq!(o.batches(100).collect::<Vec<_>>(), vec![o.indices()]);
    assert_eq!(EpochOrder::new(8000, 1, 0, true).batches(128).last().unwrap().len(), 8000 % 128);
}

#[test]
#[should_panic(expected = "batch size must be at least 1")]
fn zero_batch_size_panics() {
    let _ = EpochOrder::new(3, 0, 0, false).batches(0);
}

fn small_split() -> Split {
    let mut imgs = images(3, 2, 2);
    imgs.pixels = vec![0, 255, 51, 102, /**/ 10, 20, 30, 40, /**/ 200, 201, 202, 203];
    Split::new("imgs", imgs, "labs", vec![7, 0, 9]).unwrap()
}

#[test]
fn fill_batch_writes_normalized_pixels_and_labels_in_index_order() {
    let split = small_split();
    let norm = Normalization::FASHION_MNIST;
    assert_eq!((norm.mean, norm.std), (0.2860, 0.3530));
    assert_eq!(Normalization::default(), norm);
    let mut px = vec![f32::NAN; 2 * 4];
    let mut lb = vec![-1i64; 2];
    fill_batch(&split, &[2, 0], norm, &mut px, &mut lb).unwrap();
    assert_eq!(lb, vec![9, 7]);
    // Sample 0 lands second: pixel 255 -> (1 - 0.286) / 0.353.
    let expect = |p: f32| (p / 255.0 - 0.2860) / 0.3530;
    assert!((px[5] - expect(255.0)).abs() < 1e-6, "{}", px[5]);
    assert!((px[5] - 2.022_662_9).abs() < 1e-5, "{}", px[5]);
    assert!((px[4] - (-0.810_198_3)).abs() < 1e-5, "{}", px[4]);
    assert!((px[6] - (0.2 - 0.2860) / 0.3530).abs() < 1e-6, "p=51 -> {}", px[6]);
    for (o, p) in px[..4].iter().zip([200.0, 201.0, 202.0, 203.0]) {
        assert!((o - expect(p)).abs() < 1e-6);
    }
    // By reference too, and with plain scaling.
    #[allow(clippy::needless_borrows_for_generic_args)]
    fill_batch(&split, &[0], &Normalization::UNIT, &mut px[..4], &mut lb[..1]).unwrap();
    for (o, e) in px[..4].iter().zip([0.0, 1.0, 0.2, 0.4]) {
        assert!((o - e).abs() < 1e-7, "{o} vs {e}");
    }
    assert_eq!(lb[0], 7);
}

#[test]
fn fill_batch_rejects_wrong_buffer_lengths_and_bad_indices() {
    let split = small_split();
    let norm = Normalization::default();
    let err = fill_batch(&split, &[0, 1], norm, &mut [0.0; 7], &mut [0; 2]).unwrap_err();
    assert!(matches!(err, DataError::BatchShape { what: "pixel", expected: 8, found: 7, .. }), "{err}");
    assert!(err.to_string().contains("2 samples x 1 x 2 x 2"), "{err}");
    let err = fill_batch(&split, &[0, 1], norm, &mut [0.0; 8], &mut [0; 3]).unwrap_err();
    assert!(matches!(err, DataError::BatchShape { what: "label", expected: 2, found: 3, .. }), "{err}");
    let err = fill_batch(&split, &[0, 3], norm, &mut [0.0; 8], &mut [0; 2]).unwrap_err();
    assert!(matches!(err, DataError::IndexOutOfRange { index: 3, len: 3 }), "{err}");
    assert!(fill_batch(&split, &[], norm, &mut [], &mut []).is_ok());
}

#[test]
fn fill_batch_over_an_epoch_of_the_embedded_subset() {
    let ds = load_embedded().unwrap();
    let order = EpochOrder::new(ds.val.len(), 1, 0, true);
    let bs = 256;
    let mut px = vec![0.0f32; bs * ds.image_size()];
    let mut lb = vec![0i64; bs];
    let mut seen = 0;
    for batch in order.batches(bs) {
        let n = batch.len();
        fill_batch(&ds.val, batch, Normalization::FASHION_MNIST, &mut px[..n * 784], &mut lb[..n]).unwrap();
        assert!(lb[..n].iter().all(|&l| (0..10).contains(&l)));
        assert!(px[..n * 784].iter().all(|x| x.is_finite() && (-0.82..2.03).contains(x)));
        seen += n;
    }
    assert_eq!(seen, 2000);
}

#[test]
fn split_len_helpers() {
    let s = Split::new("i", images(4, 28, 28), "l", labels(4)).unwrap();
    assert_eq!((s.len(), s.image_size(), s.pixels_len(3)), (4, 784, 3 * 784));
    assert!(!s.is_empty());
}

proptest! {
    #[test]
    fn prop_batches_cover_each_index_once(len in 0usize..500, seed: u64, epoch in 0u64..100, bs in 1usize..64, shuffle: bool) {
        let o = EpochOrder::new(len, seed, epoch, shuffle);
        prop_assert!(is_permutation(o.indices(), len));
        let batches: Vec<&[usize]> = o.batches(bs).collect();
        prop_assert_eq!(batches.len(), o.num_batches(bs));
        prop_assert!(batches.iter().rev().skip(1).all(|b| b.len() == bs));
        if let Some(last) = batches.last() {
            prop_assert_eq!(last.len(), len - (batches.len() - 1) * bs);
        }
        let flat: Vec<usize> = batches.concat();
        prop_assert_eq!(&flat[..], o.indices());
    }
}
