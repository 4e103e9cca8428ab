//! Shapes and contents a caller can get wrong: element counts that overflow are refused with a
//! message on every device (never a wrapped count and a short buffer), and a fresh bool tensor reads
//! as valid bools.

use memfit_tensor::{Category, DType, Device, Tensor};

const HUGE: usize = 1 << 33;

#[test]
fn element_counts_that_overflow_are_errors_on_both_devices() {
    for device in [Device::cpu(), Device::meta()] {
        // 2^33 * 2^33 wraps to 0 in a usize product.
        let err = Tensor::zeros(&device, &[HUGE, HUGE], DType::F32, Category::Activation).unwrap_err();
        assert!(err.to_string().contains("more elements than fit in memory"), "{err}");
        // The element count fits, the bytes do not.
        let err = Tensor::empty(&device, &[usize::MAX / 2], DType::F32, Category::Activation, "t").unwrap_err();
        assert!(err.to_string().contains("more bytes than fit in memory"), "{err}");
        let empty = Tensor::from_slice::<f32>(&device, &[], &[HUGE, HUGE, 0], Category::Activation);
        assert!(empty.is_ok(), "a zero dim makes an empty tensor whatever the others are");
        let err = Tensor::from_slice::<f32>(&device, &[1.0], &[HUGE, HUGE], Category::Activation).unwrap_err();
        assert!(err.to_string().contains("more elements"), "{err}");

        let one = Tensor::zeros(&device, &[1, 1], DType::F32, Category::Activation).unwrap();
        let err = one.expand(&[HUGE, HUGE]).unwrap_err();
        assert!(err.to_string().contains("more elements"), "expand: {err}");
        assert_eq!(one.expand(&[HUGE, 1]).unwrap().numel(), HUGE, "a large view that fits is fine");
        let empty = Tensor::zeros(&device, &[0], DType::F32, Category::Activation).unwrap();
        assert_eq!(empty.reshape(&[HUGE as isize, 0]).unwrap().numel(), 0);
        // [2^33, 2^33 + 1] wraps to 2^33, the element count of a [2^33] view: refused, not aliased.
        // (On meta only: the cpu would have to fill 32 GiB.)
        if !device.computes() {
            let big = one.reshape(&[1]).unwrap().expand(&[HUGE]).unwrap().contiguous().unwrap();
            let err = big.reshape(&[HUGE as isize, HUGE as isize + 1]).unwrap_err();
            assert!(err.to_string().contains("more elements"), "reshape: {err}");
        }
    }
}

#[test]
fn a_fresh_bool_tensor_reads_as_false() {
    let device = Device::cpu();
    // Dirty the allocator's cache with non-bool bytes, then take a bool tensor from the same block.
    let dirty = Tensor::full(&device, &[4096], 3.0, DType::F32, Category::Activation).unwrap();
    drop(dirty);
    let mask = Tensor::empty(&device, &[64, 64], DType::Bool, Category::Activation, "mask").unwrap();
    assert!(mask.to_vec::<bool>().unwrap().iter().all(|&b| !b));
    assert_eq!(mask.to_f64_vec().unwrap().iter().sum::<f64>(), 0.0);
}
