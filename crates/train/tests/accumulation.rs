//! Gradient accumulation gives the full-batch update: N steps with the whole batch and N steps with
//! micro-batches (unequal, and a partial last window) end with the same parameters.

mod common;
use common::*;
use memfit_nn::ModelKind;
use memfit_tensor::Device;

// The comparison uses SGD with momentum and weight decay: its update is linear in the gradient, so any
// error in accumulation shows in the parameters. Adam's `m / (sqrt(v) + eps)` turns float rounding in a
// near-zero gradient into a whole +-lr step, which would make a parameter comparison measure rounding,
// not accumulation.
#[test]
fn micro_batches_with_accumulation_equal_the_full_batch() {
    for kind in [ModelKind::Mlp, ModelKind::SimpleCnn] {
        {
            let optimizer = sgd();
            let spec = small_spec(kind);
            // Windows of 16, 16, 16 and a partial 5.
            let samples = data(&spec, 3 * 16 + 5);
            let (full, full_params, _) = run(Device::cpu(), &spec, optimizer, &samples, &opts(16, 16, 4));
            assert_eq!(full.steps, 4);
            for micro in [1, 3, 5, 7] {
                let (acc, params, _) = run(Device::cpu(), &spec, optimizer, &samples, &opts(16, micro, 4));
                assert_eq!(acc.sample_log, full.sample_log, "{kind:?} micro {micro}: same samples in the same windows");
                assert_params_close(&params, &full_params, 1e-5, &format!("{kind:?} micro {micro}"));
            }
        }
    }
}

#[test]
fn losses_are_weighted_by_samples_not_by_micro_batches() {
    // A window of 5 split as 3 + 2: weighting each micro-batch by 1/2 instead of by 3/5 and 2/5
    // would give another update; the equality with the full batch proves the sample weighting.
    let spec = small_spec(ModelKind::Mlp);
    let samples = data(&spec, 5);
    let (_, full, _) = run(Device::cpu(), &spec, sgd(), &samples, &opts(5, 5, 1));
    let (_, split, _) = run(Device::cpu(), &spec, sgd(), &samples, &opts(5, 3, 1));
    assert_params_close(&split, &full, 1e-5, "3 + 2 split");
}
