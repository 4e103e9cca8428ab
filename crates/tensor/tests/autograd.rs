//! Autograd semantics: gradients that reach several places are never shared or clobbered (Note
//! [Gradient ownership]), `grad()` returns gradients without touching `.grad`, is re-entrant, and
//! grad can be enabled inside a no-grad region.

use memfit_tensor::autograd::{self, backward, grad, record, Backward};
use memfit_tensor::{Category, Device, Result, Tensor};

fn leaf(device: &Device, values: &[f64]) -> Tensor {
    Tensor::from_slice(device, values, &[values.len()], Category::Parameter).unwrap().set_requires_grad(true)
}

fn values(t: &Tensor) -> Vec<f64> {
    t.to_f64_vec().unwrap()
}

fn assert_close(got: &[f64], want: &[f64], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= 1e-12 * w.abs().max(1.0), "{what}[{i}]: got {g}, want {w}");
    }
}

/// d/dx sum(relu(x) + sigmoid(x)) = [x > 0] + s(x)(1 - s(x)).
fn relu_plus_sigmoid_grad(x: &[f64]) -> Vec<f64> {
    x.iter()
        .map(|&v| {
            let s = 1.0 / (1.0 + (-v).exp());
            f64::from(u8::from(v > 0.0)) + s * (1.0 - s)
        })
        .collect()
}

#[test]
fn relu_plus_sigmoid_of_one_input_gets_both_gradients() {
    let device = Device::cpu();
    let xv = [0.5, -0.3, 1.2, 2.0];
    let x = leaf(&device, &xv);
    backward(&x.relu().unwrap().add(&x.sigmoid().unwrap()).unwrap().sum_all().unwrap()).unwrap();
    let got = values(&x.grad().unwrap());
    assert_close(&got, &relu_plus_sigmoid_grad(&xv), "x.grad");
    // The numbers, to three decimals.
    for (g, want) in got.iter().zip([1.235, 0.244, 1.178, 1.105]) {
        assert!((g - want).abs() < 1e-3, "{got:?}");
    }
}

#[test]
fn two_leaves_added_get_separate_gradients_that_accumulate() {
    let device = Device::cpu();
    let a = leaf(&device, &[1.0, 2.0, 3.0]);
    let b = leaf(&device, &[4.0, 5.0, 6.0]);
    for _ in 0..2 {
        backward(&a.add(&b).unwrap().sum_all().unwrap()).unwrap();
    }
    let (ga, gb) = (a.grad().unwrap(), b.grad().unwrap());
    assert_eq!(values(&ga), vec![2.0; 3]);
    assert_eq!(values(&gb), vec![2.0; 3]);
    assert!(!std::sync::Arc::ptr_eq(ga.storage(), gb.storage()), "a.grad and b.grad share memory");
    // Mutating one gradient leaves the other alone.
    memfit_tensor::ops::add_into(&ga, &Tensor::from_slice(&device, &[10.0f64; 3], &[3], Category::Input).unwrap())
        .unwrap();
    assert_eq!(values(&a.grad().unwrap()), vec![12.0; 3]);
    assert_eq!(values(&b.grad().unwrap()), vec![2.0; 3]);
}

#[test]
fn x_plus_x_gives_two() {
    let device = Device::cpu();
    let x = leaf(&device, &[1.0, -2.0]);
    backward(&x.add(&x).unwrap().sum_all().unwrap()).unwrap();
    assert_eq!(values(&x.grad().unwrap()), vec![2.0, 2.0]);
    // And through an op that could run in place on the shared gradient.
    let y = leaf(&device, &[0.3, -0.7]);
    backward(&y.add(&y).unwrap().tanh().unwrap().sum_all().unwrap()).unwrap();
    let want: Vec<f64> = [0.3f64, -0.7].iter().map(|v| 2.0 * (1.0 - (2.0 * v).tanh().powi(2))).collect();
    assert_close(&values(&y.grad().unwrap()), &want, "y.grad");
}

#[test]
fn a_gradient_the_caller_still_holds_is_not_written_over() {
    let device = Device::cpu();
    let x = leaf(&device, &[0.5, -1.0, 2.0]);
    let seed = Tensor::from_slice(&device, &[1.0, 2.0, 3.0], &[3], Category::Input).unwrap();
    autograd::backward_with(&x.relu().unwrap(), seed.clone()).unwrap();
    assert_eq!(values(&seed), vec![1.0, 2.0, 3.0], "the caller's gradient changed");
    assert_eq!(values(&x.grad().unwrap()), vec![1.0, 0.0, 3.0]);
    // A leaf's own seed becomes its .grad only as a copy: accumulating later must not touch it.
    let y = leaf(&device, &[1.0, 1.0, 1.0]);
    autograd::backward_with(&y, seed.clone()).unwrap();
    autograd::backward_with(&y, seed.clone()).unwrap();
    assert_eq!(values(&seed), vec![1.0, 2.0, 3.0]);
    assert_eq!(values(&y.grad().unwrap()), vec![2.0, 4.0, 6.0]);
}

#[test]
fn grad_matches_backward_and_leaves_dot_grad_alone() {
    let device = Device::cpu();
    let xv = [0.5, -0.3, 1.2, 2.0];
    let x = leaf(&device, &xv);
    let w = leaf(&device, &[2.0, 3.0, 4.0, 5.0]);
    let f = || x.relu().unwrap().add(&x.sigmoid().unwrap()).unwrap().mul(&w).unwrap().sum_all().unwrap();
    let got = grad(&[f()], &[None], &[x.clone(), w.clone()]).unwrap();
    assert!(x.grad().is_none() && w.grad().is_none(), "grad() wrote .grad");
    backward(&f()).unwrap();
    assert_close(&values(got[0].as_ref().unwrap()), &values(&x.grad().unwrap()), "dx");
    assert_close(&values(got[1].as_ref().unwrap()), &values(&w.grad().unwrap()), "dw");
    let want: Vec<f64> = relu_plus_sigmoid_grad(&xv).iter().zip([2.0, 3.0, 4.0, 5.0]).map(|(g, w)| g * w).collect();
    assert_close(&values(got[0].as_ref().unwrap()), &want, "dx analytic");
}

#[test]
fn grad_wrt_an_intermediate_and_an_unused_input() {
    let device = Device::cpu();
    let x = leaf(&device, &[1.0, 2.0]);
    let unused = leaf(&device, &[5.0]);
    let h = x.mul_scalar(3.0).unwrap();
    let y = h.mul(&h).unwrap().sum_all().unwrap(); // dy/dh = 2h = [6, 12]; dy/dx = 3 * 2h = [18, 36]
    let got = grad(&[y], &[None], &[h.clone(), x.clone(), unused.clone()]).unwrap();
    assert_eq!(values(got[0].as_ref().unwrap()), vec![6.0, 12.0]);
    assert_eq!(values(got[1].as_ref().unwrap()), vec![18.0, 36.0]);
    assert!(got[2].is_none());
    assert!(x.grad().is_none());
    // Only the intermediate: the graph behind it (down to x) need not run, but its own gradient arrives.
    let h = x.mul_scalar(3.0).unwrap();
    let y = h.mul(&h).unwrap().sum_all().unwrap();
    let got = grad(&[y], &[None], std::slice::from_ref(&h)).unwrap();
    assert_eq!(values(got[0].as_ref().unwrap()), vec![6.0, 12.0]);
}

#[test]
fn grad_of_several_outputs_adds_their_contributions() {
    let device = Device::cpu();
    let x = leaf(&device, &[1.0, 2.0]);
    let a = x.mul_scalar(2.0).unwrap();
    let b = x.mul(&x).unwrap();
    let ga = Tensor::from_slice(&device, &[1.0, 1.0], &[2], Category::Input).unwrap();
    let gb = Tensor::from_slice(&device, &[1.0, 10.0], &[2], Category::Input).unwrap();
    let got = grad(&[a, b], &[Some(ga), Some(gb)], std::slice::from_ref(&x)).unwrap();
    assert_eq!(values(got[0].as_ref().unwrap()), vec![2.0 + 2.0, 2.0 + 40.0]);
    // One output computed from the other: h's node runs only after y's backward reached it.
    let h = x.mul_scalar(3.0).unwrap();
    let y = h.mul(&h).unwrap().sum_all().unwrap();
    let ones = Tensor::from_slice(&device, &[1.0, 1.0], &[2], Category::Input).unwrap();
    let got = grad(&[y, h.clone()], &[None, Some(ones)], std::slice::from_ref(&x)).unwrap();
    // d/dx (sum(h^2) + sum(h)) = 3 * (2h + 1), h = [3, 6].
    assert_eq!(values(got[0].as_ref().unwrap()), vec![21.0, 39.0]);
}

/// A backward that re-runs its forward (y = x * x) with grad enabled and differentiates it with
/// `grad()`: what activation checkpointing does.
struct Recompute {
    x: Tensor,
}

impl Backward for Recompute {
    fn backward(self: Box<Self>, g: Tensor, _: &[bool]) -> Result<Vec<Option<Tensor>>> {
        let device = self.x.device().clone();
        assert!(!device.grad_enabled(), "backward runs under no-grad");
        let x = self.x.detach().set_requires_grad(true);
        let y = {
            let _enable = device.enable_grad();
            x.mul(&x)?
        };
        assert!(!device.grad_enabled(), "enable_grad restores no-grad");
        let mut grads = grad(&[y], &[Some(g)], &[x])?;
        Ok(vec![grads.pop().flatten()])
    }
}

#[test]
fn grad_is_reentrant_from_inside_a_backward() {
    let device = Device::cpu();
    let x = leaf(&device, &[1.5, -2.0]);
    let y = {
        let _ng = device.no_grad();
        x.mul(&x).unwrap()
    };
    assert!(!y.requires_grad());
    let y = record(y, "recompute", &[&x], Recompute { x: x.detach() });
    let z = y.mul_scalar(3.0).unwrap().sum_all().unwrap();
    backward(&z).unwrap();
    assert_eq!(values(&x.grad().unwrap()), vec![9.0, -12.0]);
}

#[test]
fn grad_errors_are_clear() {
    let device = Device::cpu();
    let x = leaf(&device, &[1.0, 2.0]);
    let y = x.mul_scalar(2.0).unwrap();
    let e = grad(std::slice::from_ref(&y), &[None], std::slice::from_ref(&x)).unwrap_err().to_string();
    assert!(e.contains("scalar"), "{e}");
    let e = grad(&[y], &[], &[x]).unwrap_err().to_string();
    assert!(e.contains("gradients"), "{e}");
    // A tensor that is no graph's output and wants no gradient has nothing to differentiate.
    let plain = Tensor::full(&device, &[], 1.0, memfit_tensor::DType::F64, Category::Input).unwrap();
    let e = backward(&plain).unwrap_err().to_string();
    assert!(e.contains("does not require grad"), "{e}");
    let e = grad(&[plain.clone()], &[None], &[plain]).unwrap_err().to_string();
    assert!(e.contains("does not require grad"), "{e}");
}

#[test]
fn meta_allocates_like_cpu_for_shared_gradients() {
    let run = |device: Device| {
        let x = Tensor::zeros(&device, &[64, 64], memfit_tensor::DType::F32, Category::Parameter)
            .unwrap()
            .set_requires_grad(true);
        let y = x.relu().unwrap().add(&x.sigmoid().unwrap()).unwrap().add(&x).unwrap();
        backward(&y.sum_all().unwrap()).unwrap();
        let s = device.stats();
        (s.allocated_bytes.peak, s.allocation.allocated, s.allocated_bytes.current)
    };
    assert_eq!(run(Device::cpu()), run(Device::meta()));
}

#[test]
fn grad_runs_only_what_leads_to_its_inputs() {
    // y = sum(x * w) + sum(tanh(z)): asking for x's gradient must neither differentiate w's side of
    // the product nor the z branch. Counted by the allocations of the backward pass.
    let allocations_of_grad = |with_z: bool, inputs: &dyn Fn(&Tensor, &Tensor) -> Vec<Tensor>| {
        let device = Device::cpu();
        let x = leaf(&device, &[1.0; 64]);
        let w = leaf(&device, &[2.0; 64]);
        let z = leaf(&device, &[0.5; 64]);
        let mut y = x.mul(&w).unwrap().sum_all().unwrap();
        if with_z {
            y = y.add(&z.tanh().unwrap().sum_all().unwrap()).unwrap();
        }
        let before = device.stats().allocation.allocated;
        let got = grad(&[y], &[None], &inputs(&x, &w)).unwrap();
        assert_eq!(values(got[0].as_ref().unwrap()), vec![2.0; 64]);
        device.stats().allocation.allocated - before
    };
    let only_x = allocations_of_grad(false, &|x, _| vec![x.clone()]);
    let x_and_w = allocations_of_grad(false, &|x, w| vec![x.clone(), w.clone()]);
    assert!(only_x < x_and_w, "w's gradient was computed for nothing ({only_x} vs {x_and_w} allocations)");
    let with_branch = allocations_of_grad(true, &|x, _| vec![x.clone()]);
    // The add passes its gradient on without allocating; the z branch (sum and tanh backward) must not run.
    assert_eq!(with_branch, only_x, "an unrelated branch ran");
}

/// A chain of products whose weights outweigh its activations (one row of 32), so that what a pass
/// holds of the gradients decides its peak. Its leaves get their gradients at different moments: `w1`
/// is used first and last (complete only at the end), `a` and `b` share one gradient (`a + b`), and
/// `unused` is reached but gets no gradient (its node returns none). The loss of micro-batch `k`.
fn network_loss(device: &Device, leaves: &[Tensor], k: usize) -> Tensor {
    let [w1, w2, w3, a, b, unused] = leaves else { panic!("six leaves") };
    let xv: Vec<f64> = (0..32).map(|i| ((i * 7 + k * 3) % 11) as f64 / 5.0 - 1.0).collect();
    let x = Tensor::from_slice(device, &xv, &[1, 32], Category::Input).unwrap();
    let linear = memfit_tensor::ops::linear;
    let h = linear(&x, w1, None).unwrap().tanh().unwrap();
    let h = linear(&h, w2, Some(&a.add(b).unwrap())).unwrap().tanh().unwrap();
    let y = linear(&linear(&h, w3, None).unwrap(), w1, None).unwrap();
    let zero = unused.detach().mul_scalar(0.0).unwrap().sum_all().unwrap();
    y.mul(&y).unwrap().sum_all().unwrap().add(&zero).unwrap()
}

fn network(device: &Device) -> Vec<Tensor> {
    let param = |shape: &[usize], salt: usize| {
        let n = shape.iter().product::<usize>();
        let v: Vec<f64> = (0..n).map(|i| ((i * 13 + salt) % 17) as f64 / 40.0 - 0.2).collect();
        Tensor::from_slice(device, &v, shape, Category::Parameter).unwrap().set_requires_grad(true)
    };
    let w = |salt| param(&[32, 32], salt);
    vec![w(1), w(2), w(3), param(&[32], 4), param(&[32], 5), param(&[32], 6)]
}

/// Accumulating three micro-batches, committing each leaf as soon as it is complete gives `.grad` the
/// transactional pass's bits, holds less at the pass's peak, and allocates identically on meta.
#[test]
fn committing_as_complete_gives_the_same_gradients_with_a_lower_peak() {
    let run = |device: &Device, as_complete: bool| {
        let leaves = network(device);
        let mut peaks = Vec::new();
        for k in 0..3 {
            let loss = network_loss(device, &leaves, k);
            device.reset_peak_stats();
            if as_complete {
                autograd::backward_as_complete(&loss, None).unwrap();
            } else {
                backward(&loss).unwrap();
            }
            peaks.push(device.stats().allocated_bytes.peak);
        }
        let grads: Vec<Option<Vec<f64>>> =
            leaves.iter().map(|l| l.grad().map(|g| if device.computes() { values(&g) } else { vec![] })).collect();
        (grads, peaks)
    };
    let cpu = Device::cpu();
    let (transactional, peaks_transactional) = run(&cpu, false);
    let (as_complete, peaks_as_complete) = run(&cpu, true);
    assert_eq!(as_complete, transactional, "the same .grad bits");
    assert!(as_complete[5].is_none(), "a leaf that got no gradient gets none");
    for k in 1..3 {
        assert!(
            peaks_as_complete[k] < peaks_transactional[k],
            "accumulating, the pass holds less: {peaks_as_complete:?} vs {peaks_transactional:?}"
        );
    }
    let meta = Device::meta();
    assert_eq!(run(&meta, true).1, peaks_as_complete, "meta predicts it");
}

/// A scalar leaf as the output itself, and a leaf the output reaches twice (`x + x`): counted and
/// committed once, with both contributions.
#[test]
fn committing_as_complete_counts_every_edge_into_a_leaf() {
    let device = Device::cpu();
    let x = leaf(&device, &[1.0, 2.0]);
    autograd::backward_as_complete(&x.add(&x).unwrap().sum_all().unwrap(), None).unwrap();
    autograd::backward_as_complete(&x.add(&x).unwrap().sum_all().unwrap(), None).unwrap();
    assert_eq!(values(&x.grad().unwrap()), [4.0, 4.0]);
    let s = leaf(&device, &[3.0]);
    autograd::backward_as_complete(&s, None).unwrap();
    assert_eq!(values(&s.grad().unwrap()), [1.0]);
}

#[test]
fn handing_over_gives_each_leaf_its_complete_gradient_once_and_leaves_grad_alone() {
    let device = Device::cpu();
    let (xv, yv) = ([0.5, -0.3, 1.2], [2.0, 0.25, -1.5]);
    // x is read twice (its gradient completes only after both), y once, z by nothing that leads to the
    // loss (no gradient reaches it: it is never handed over).
    let loss_of = |x: &Tensor, y: &Tensor, z: &Tensor| {
        let _unused = z.mul(z).unwrap();
        x.mul(y).unwrap().add(&x.relu().unwrap()).unwrap().sum_all().unwrap()
    };
    let (x, y, z) = (leaf(&device, &xv), leaf(&device, &yv), leaf(&device, &[1.0]));
    backward(&loss_of(&x, &y, &z)).unwrap();
    let (want_x, want_y) = (values(&x.grad().unwrap()), values(&y.grad().unwrap()));

    let (x, y, z) = (leaf(&device, &xv), leaf(&device, &yv), leaf(&device, &[1.0]));
    let mut handed: Vec<(String, Vec<f64>)> = Vec::new();
    autograd::backward_handing_over(&loss_of(&x, &y, &z), &mut |leaf, g| {
        let name = if leaf.same(&x) {
            "x"
        } else if leaf.same(&y) {
            "y"
        } else {
            "other"
        };
        handed.push((name.to_string(), values(&g)));
        Ok(())
    })
    .unwrap();
    handed.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(handed, vec![("x".to_string(), want_x), ("y".to_string(), want_y)]);
    assert!(x.grad().is_none() && y.grad().is_none() && z.grad().is_none(), ".grad untouched");

    // An error from the receiver ends the pass with it.
    let x = leaf(&device, &xv);
    let err = autograd::backward_handing_over(&x.relu().unwrap().sum_all().unwrap(), &mut |_, _| {
        Err(memfit_tensor::Error::invalid("refused"))
    });
    assert!(err.unwrap_err().to_string().contains("refused"));
}
