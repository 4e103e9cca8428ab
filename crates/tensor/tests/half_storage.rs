//! The mechanism of half-precision storage (Note [Half-precision storage]): which saved tensors
//! `save_compact` converts (f32 op outputs, not parameters, inputs, other dtypes or a checkpointed
//! re-run), that they come back as f32 rounded to the half format, and which saved dtypes a device
//! accepts.

use memfit_tensor::autograd::save_compact;
use memfit_tensor::{Category, DType, Device, Tensor};

fn tensor(device: &Device, values: &[f32], category: Category) -> Tensor {
    Tensor::from_slice(device, values, &[values.len()], category).unwrap()
}

/// The same storage (a saved handle is a detached view of it).
fn shared(a: &std::sync::Arc<memfit_tensor::Storage>, b: &std::sync::Arc<memfit_tensor::Storage>) -> bool {
    std::sync::Arc::ptr_eq(a, b)
}

const VALUES: [f32; 4] = [1.0, 1.0 + 1.0 / 256.0 + 1.0 / 1024.0, -3.14159, 65504.0 * 2.0];

#[test]
fn a_device_stores_saved_activations_only_in_a_half_format() {
    let device = Device::cpu();
    assert_eq!(device.saved_dtype(), None, "by default tensors are saved as they are");
    for dtype in [DType::F32, DType::F64, DType::I64, DType::U8, DType::Bool] {
        let err = device.set_saved_dtype(Some(dtype)).unwrap_err().to_string();
        assert!(err.contains("bf16 or f16"), "{dtype}: {err}");
        assert_eq!(device.saved_dtype(), None);
    }
    for dtype in [DType::BF16, DType::F16] {
        device.set_saved_dtype(Some(dtype)).unwrap();
        assert_eq!(device.saved_dtype(), Some(dtype));
    }
    device.set_saved_dtype(None).unwrap();
    assert_eq!(device.saved_dtype(), None);
}

#[test]
fn op_outputs_are_stored_in_half_and_restored_rounded_to_it() {
    for half in [DType::BF16, DType::F16] {
        let device = Device::cpu();
        device.set_saved_dtype(Some(half)).unwrap();
        for category in [Category::Temporary, Category::Activation] {
            let t = tensor(&device, &VALUES, category);
            let saved = save_compact(&t).unwrap();
            assert_eq!(saved.shape(), &[4]);
            let restored = saved.restore().unwrap();
            assert_eq!(restored.dtype(), DType::F32);
            let want = t.to_dtype(half).unwrap().to_dtype(DType::F32).unwrap().to_vec::<f32>().unwrap();
            assert_eq!(restored.to_vec::<f32>().unwrap(), want, "{half}: rounded as a cast rounds");
            assert_ne!(want, VALUES.to_vec(), "{half}: the values do not all survive the format");
            assert_eq!(saved.into_tensor().unwrap().to_vec::<f32>().unwrap(), want);
        }
    }
}

#[test]
fn parameters_inputs_other_dtypes_and_unset_devices_are_saved_as_they_are() {
    let device = Device::cpu();
    let plain = tensor(&device, &VALUES, Category::Temporary);
    let saved = save_compact(&plain).unwrap();
    assert!(shared(saved.into_tensor().unwrap().storage(), plain.storage()), "no saved dtype: the same storage");
    device.set_saved_dtype(Some(DType::BF16)).unwrap();
    for category in [Category::Parameter, Category::Input] {
        let t = tensor(&device, &VALUES, category);
        assert!(
            shared(save_compact(&t).unwrap().into_tensor().unwrap().storage(), t.storage()),
            "{category:?} lives anyway"
        );
    }
    let f64s = Tensor::from_slice(&device, &[1.0f64, 2.0], &[2], Category::Temporary).unwrap();
    assert!(
        shared(save_compact(&f64s).unwrap().into_tensor().unwrap().storage(), f64s.storage()),
        "only f32 is halved"
    );
    let t = tensor(&device, &VALUES, Category::Temporary);
    let _rerun = device.recompute();
    assert!(
        shared(save_compact(&t).unwrap().into_tensor().unwrap().storage(), t.storage()),
        "a checkpointed re-run keeps f32"
    );
}

#[test]
fn the_half_copy_is_an_activation_of_half_the_bytes_and_the_same_on_meta() {
    let mut events = Vec::new();
    for device in [Device::cpu(), Device::meta()] {
        device.set_saved_dtype(Some(DType::BF16)).unwrap();
        let t = Tensor::zeros(&device, &[1024], DType::F32, Category::Temporary).unwrap();
        let before = device.stats().category(Category::Activation).current;
        let saved = save_compact(&t).unwrap();
        let after = device.stats().category(Category::Activation).current;
        assert_eq!(after - before, 2048, "1024 bf16 values, re-tagged as an activation");
        drop(saved);
        events.push(device.timeline_events());
    }
    assert_eq!(events[0], events[1]);
}

/// Note [Shared compact copies]: a second save of the same view takes the copy the first made while
/// a saved handle holds it; another view, or a save after every holder let go, converts anew. The
/// same on meta.
#[test]
fn two_saves_of_one_view_share_one_half_copy_while_it_is_held() {
    let mut events = Vec::new();
    for device in [Device::cpu(), Device::meta()] {
        device.set_saved_dtype(Some(DType::BF16)).unwrap();
        let t = Tensor::zeros(&device, &[1024], DType::F32, Category::Temporary).unwrap();
        let copies = || device.stats().category(Category::Activation).current;
        let first = save_compact(&t).unwrap();
        let second = save_compact(&t).unwrap();
        assert_eq!(copies(), 2048, "one bf16 copy for both saves");
        assert_eq!(first.shape(), second.shape());
        let half = t.narrow(0, 0, 512).unwrap();
        let other_view = save_compact(&half).unwrap();
        assert_eq!(copies(), 2048 + 1024, "another view: its own copy");
        drop((first, second, other_view));
        assert_eq!(copies(), 0, "the copies go with their last holders");
        let again = save_compact(&t).unwrap();
        assert_eq!(copies(), 2048, "a copy nobody holds is made again");
        drop(again);
        events.push(device.timeline_events());
    }
    assert_eq!(events[0], events[1]);
    let device = Device::cpu();
    device.set_saved_dtype(Some(DType::BF16)).unwrap();
    let t = tensor(&device, &VALUES, Category::Temporary);
    let (a, b) = (save_compact(&t).unwrap(), save_compact(&t).unwrap());
    let want = t.to_dtype(DType::BF16).unwrap().to_dtype(DType::F32).unwrap().to_vec::<f32>().unwrap();
    assert_eq!(a.restore().unwrap().to_vec::<f32>().unwrap(), want);
    assert_eq!(b.into_tensor().unwrap().to_vec::<f32>().unwrap(), want, "the shared copy restores as its own would");
}
