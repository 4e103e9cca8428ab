//! `ops::linear_cross_entropy` (Note [Chunked head] in `ops/loss.rs`): the head's product and the loss
//! taken a few rows at a time give the unchunked op's loss, argmax and gradients (up to the order of
//! float additions), hold one chunk of logits at a time, and allocate on `meta` exactly what the cpu
//! allocates.

use memfit_tensor::autograd::backward_with;
use memfit_tensor::{ops, Category, DType, Device, DeviceConfig, DeviceKind, Result, Tensor};

fn values(n: usize, seed: u64) -> Vec<f64> {
    (0..n).map(|i| (((i as u64 * 2654435761 + seed * 97) % 1000) as f64 / 500.0) - 1.0).collect()
}

struct Run {
    loss: f64,
    predicted: Vec<i64>,
    grads: Vec<Vec<f64>>,
}

/// The head and loss over x [10, 4], W [7, 4], b [7] (f64), fused with `chunk` rows or (None) as
/// linear, cross-entropy and argmax, then backward with upstream gradient 2.5.
fn run(device: &Device, chunk: Option<usize>, bias: bool, smoothing: f64) -> Result<Run> {
    let (n, d, v) = (10, 4, 7);
    let leaf = |len: usize, shape: &[usize], seed| {
        Tensor::from_slice(device, &values(len, seed), shape, Category::Parameter).map(|t| t.set_requires_grad(true))
    };
    let (x, w, b) = (leaf(n * d, &[n, d], 1)?, leaf(v * d, &[v, d], 2)?, leaf(v, &[v], 3)?);
    let targets: Vec<i64> = (0..n as i64).map(|r| (r * 3) % v as i64).collect();
    let t = Tensor::from_slice(device, &targets, &[n], Category::Input)?;
    let b_opt = bias.then_some(&b);
    let (loss, predicted) = match chunk {
        Some(c) => ops::linear_cross_entropy(&x, &w, b_opt, &t, smoothing, c)?,
        None => {
            let logits = ops::linear(&x, &w, b_opt)?;
            let predicted = logits.detach().max_dim(-1, false)?.1;
            (ops::cross_entropy(&logits, &t, smoothing)?, predicted)
        }
    };
    let upstream = Tensor::full(device, &[], 2.5, DType::F64, Category::Input)?;
    backward_with(&loss, upstream)?;
    if !device.computes() {
        return Ok(Run { loss: 0.0, predicted: vec![], grads: vec![] });
    }
    let mut grads = vec![x.grad().unwrap().to_f64_vec()?, w.grad().unwrap().to_f64_vec()?];
    if bias {
        grads.push(b.grad().unwrap().to_f64_vec()?);
    }
    Ok(Run { loss: loss.item()?, predicted: predicted.to_vec::<i64>()?, grads })
}

#[test]
fn chunked_head_gives_the_unchunked_loss_argmax_and_gradients() {
    let cpu = Device::cpu();
    for (bias, smoothing) in [(true, 0.0), (false, 0.1), (true, 0.2)] {
        let want = run(&cpu, None, bias, smoothing).unwrap();
        for chunk in [1, 3, 4, 10, 64] {
            let got = run(&cpu, Some(chunk), bias, smoothing).unwrap();
            let what = format!("chunk {chunk}, bias {bias}, smoothing {smoothing}");
            assert!(
                (got.loss - want.loss).abs() <= 1e-12 * want.loss.abs(),
                "{what}: loss {} vs {}",
                got.loss,
                want.loss
            );
            assert_eq!(got.predicted, want.predicted, "{what}: argmax");
            assert_eq!(got.grads.len(), want.grads.len());
            for (k, (g, w)) in got.grads.iter().zip(&want.grads).enumerate() {
                for (i, (a, b)) in g.iter().zip(w).enumerate() {
                    assert!((a - b).abs() <= 1e-12, "{what}: gradient {k} element {i}: {a} vs {b}");
                }
            }
        }
    }
}

/// meta allocates what the cpu allocates, and a chunked head's peak is below the unchunked one's
/// (one chunk of logits and of their gradient, not all of them).
#[test]
fn chunked_head_peaks_lower_and_meta_predicts_it() {
    let peak = |kind: DeviceKind, chunk: Option<usize>| {
        let device = Device::new(DeviceConfig::new(kind)).unwrap();
        run(&device, chunk, true, 0.0).unwrap();
        device.stats().allocated_bytes.peak
    };
    for chunk in [Some(2), Some(5), None] {
        assert_eq!(peak(DeviceKind::Cpu, chunk), peak(DeviceKind::META, chunk), "chunk {chunk:?}");
    }
    // Logits of 10 x 7 f64 are one 512-byte block either way; a wide head shows the difference.
    let wide = |chunk: Option<usize>| -> u64 {
        let device = Device::cpu();
        let (n, d, v) = (256, 8, 1000);
        let x =
            Tensor::from_slice(&device, &values(n * d, 1), &[n, d], Category::Input).unwrap().set_requires_grad(true);
        let w = Tensor::from_slice(&device, &values(v * d, 2), &[v, d], Category::Parameter)
            .unwrap()
            .set_requires_grad(true);
        let t = Tensor::from_slice(&device, &(0..n as i64).collect::<Vec<_>>(), &[n], Category::Input).unwrap();
        let before = device.stats().allocated_bytes.current;
        let loss = match chunk {
            Some(c) => ops::linear_cross_entropy(&x, &w, None, &t, 0.0, c).unwrap().0,
            None => ops::cross_entropy(&ops::linear(&x, &w, None).unwrap(), &t, 0.0).unwrap(),
        };
        memfit_tensor::autograd::backward(&loss).unwrap();
        device.stats().allocated_bytes.peak - before
    };
    let (chunked, whole) = (wide(Some(32)), wide(None));
    let logits = (256 * 1000 * 8) as u64;
    assert!(chunked + logits <= whole, "chunked peak {chunked} B vs unchunked {whole} B (logits {logits} B)");
}

#[test]
fn chunked_head_refuses_bad_targets_and_shapes() {
    let cpu = Device::cpu();
    let x = Tensor::from_slice(&cpu, &values(8, 1), &[2, 4], Category::Input).unwrap();
    let w = Tensor::from_slice(&cpu, &values(12, 2), &[3, 4], Category::Input).unwrap();
    let t = |v: &[i64], shape: &[usize]| Tensor::from_slice(&cpu, v, shape, Category::Input).unwrap();
    let err = |r: Result<(Tensor, Tensor)>| r.err().map(|e| e.to_string()).unwrap_or_default();
    assert!(err(ops::linear_cross_entropy(&x, &w, None, &t(&[0, 1, 2], &[3]), 0.0, 1)).contains("target [2]"));
    assert!(err(ops::linear_cross_entropy(&x, &w, None, &t(&[0, 5], &[2]), 0.0, 1)).contains("out of range"));
    let f = Tensor::from_slice(&cpu, &[0.0, 1.0], &[2], Category::Input).unwrap();
    assert!(err(ops::linear_cross_entropy(&x, &w, None, &f, 0.0, 1)).contains("int64"));
    assert!(err(ops::linear_cross_entropy(&x, &w, None, &t(&[0, 1], &[2]), 1.5, 1)).contains("label_smoothing"));
}
